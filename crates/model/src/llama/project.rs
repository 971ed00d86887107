//! The block's projections: `x · wᵀ` for the linears that read one input (q, k, v; gate, up;
//! o and down alone) and their backward, in the model dtype or, where the layer's linears run
//! in FP8, from operands made once: the input's rounding or codes for every linear that reads
//! it, each weight's for the step (`Parameter::fp8_operand`), the input's rounding along the
//! tokens for every weight gradient. The input gradients of linears sharing an input are
//! summed in the order given.

use candle_core::{Result, Shape, Tensor};

use super::{Fp8Mode, Llama};
use crate::ops::{self, linear_to, Fp8Operand};
use crate::segment::ParamGrad;

/// A projection's backward: the input gradient `g · w` (in `x`'s shape) and the weight gradient
/// `gᵀ · x` as its factors, for the gradient buffer to accumulate with one GEMM.
pub(crate) fn projection_bwd(x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Tensor, ParamGrad)> {
    let dx = ops::linear_dx(w, g, x.shape())?;
    let (g, x) = ops::linear_factors(x, w, g)?;
    Ok((dx, ParamGrad::Product { g, x }))
}

impl Llama {
    /// `x · wᵢᵀ` for each `(i, shape)` of `outs`, linears that read one input (q, k, v; gate,
    /// up; or one alone). Where layer `layer`'s linears run in FP8 the input is rounded or
    /// quantized once for all of them, and each weight once per step (its kept operand).
    pub(super) fn project<const N: usize>(
        &self,
        layer: usize,
        x: &Tensor,
        outs: [(usize, Shape); N],
    ) -> Result<[Tensor; N]> {
        let mut ys = Vec::with_capacity(N);
        match self.fp8_at(layer) {
            Some(mode) => {
                let xq = super::fp8::input_operand(x, self.fan_in(&outs)?, mode)?; // [rows, in]
                for (i, shape) in outs {
                    ys.push(ops::fp8_linear_of(&xq, &self.fp8_weight(i, mode)?, shape)?);
                }
            }
            None => {
                for (i, shape) in outs {
                    ys.push(linear_to(x, &self.w(i)?, shape)?);
                }
            }
        }
        Ok(ys
            .try_into()
            .unwrap_or_else(|_| unreachable!("one output per linear")))
    }

    /// The features of the input the linears `(i, _)` of `of` read (the first one's `in`).
    fn fan_in<T>(&self, of: &[(usize, T)]) -> Result<usize> {
        match of.first() {
            Some(&(i, _)) => Ok(self.params.get(i).block.shape[1]),
            None => candle_core::bail!("a projection without a linear"),
        }
    }

    /// Parameter `i` as the FP8 linears of `mode` read it, kept for the step.
    fn fp8_weight(&self, i: usize, mode: Fp8Mode) -> Result<Fp8Operand> {
        let p = self.params.get(i);
        p.fp8_operand(mode, |w| super::fp8::weight_operand(w, mode))
    }

    /// The backward of [`Llama::project`] for upstream gradients `gs` `(i, g)`: the input's
    /// gradient, the linears' contributions summed in `gs`'s order, and each weight's gradient
    /// as its factors (the input's rounding along the tokens shared, in FP8).
    pub(super) fn project_bwd<const N: usize>(
        &self,
        layer: usize,
        x: &Tensor,
        gs: [(usize, &Tensor); N],
    ) -> Result<(Tensor, [(usize, ParamGrad); N])> {
        let mut dx: Option<Tensor> = None;
        let mut grads = Vec::with_capacity(N);
        let fp8 = match self.fp8_at(layer) {
            Some(mode) => {
                let by_token = super::fp8::input_by_token(x, self.fan_in(&gs)?, mode)?;
                Some((mode, by_token))
            }
            None => None,
        };
        for (i, g) in gs {
            let (d, pg) = match &fp8 {
                Some((mode, by_token)) => {
                    let wq = self.fp8_weight(i, *mode)?;
                    super::fp8::projection_bwd_of(x, Some(by_token), &wq, g, *mode)?
                }
                None => projection_bwd(x, &self.w(i)?, g)?,
            };
            dx = Some(match dx {
                Some(sum) => ops::add(&sum, &d)?,
                None => d,
            });
            grads.push((i, pg));
        }
        let grads = grads
            .try_into()
            .unwrap_or_else(|_| unreachable!("one per linear"));
        match dx {
            Some(dx) => Ok((dx, grads)),
            None => candle_core::bail!("a projection's backward with no upstream gradient"),
        }
    }
}
