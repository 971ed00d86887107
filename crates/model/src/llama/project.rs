//! The block's projections: `x · wᵀ` for the linears that read one input (q, k, v; gate, up;
//! o and down alone) and their backward.
//!
//! - In the model dtype, linears sharing an input run fused, as Megatron's `linear_qkv` and
//!   `linear_fc1`: one GEMM over their stacked weights (`ParamSet::span`, a view where the
//!   weights are packed) for the forward, and one for the input gradient over their upstream
//!   gradients side by side; the weight gradients stay one GEMM per weight, into its own slot.
//!   q, k and v are copied out of the fused output (RoPE and attention read them whole) and
//!   their gradients joined; gate and up stay joined (`GateUp::Joined`: the SwiGLU and its
//!   backward read and write that layout, and each weight gradient reads its columns in place).
//! - Where the layer's linears run in FP8 (each weight with its own scales), from operands made
//!   once: the input's rounding or codes for every linear that reads it, each weight's for the
//!   step (`Parameter::fp8_operand`), the input's rounding along the tokens for every weight
//!   gradient; the input gradients are summed in the order given.

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

/// The MLP's gate and up projections as a block keeps them for the SwiGLU and its backward.
pub(super) enum GateUp {
    /// Side by side `[b, s, 2f/tp]`, each row's gate then its up: the fused GEMM's output.
    Joined(Tensor),
    /// Apart, `[b, s, f/tp]` each (FP8 linears).
    Apart(Tensor, Tensor),
}

impl GateUp {
    /// `silu(gate) · up` `[b, s, f/tp]`.
    pub(super) fn act(&self) -> Result<Tensor> {
        match self {
            GateUp::Joined(gu) => ops::swiglu_joined(gu),
            GateUp::Apart(gate, up) => ops::swiglu(gate, up),
        }
    }

    /// The tensors kept.
    pub(super) fn tensors(&self) -> Vec<&Tensor> {
        match self {
            GateUp::Joined(gu) => vec![gu],
            GateUp::Apart(gate, up) => vec![gate, up],
        }
    }
}

impl Llama {
    /// The gate and up projections of `x` `[b, s, h]` (parameters `gate`, `up`): joined by one
    /// GEMM in the model dtype, apart where the layer's linears run in FP8.
    pub(super) fn gate_up(
        &self,
        layer: usize,
        x: &Tensor,
        [gate, up]: [usize; 2],
    ) -> Result<GateUp> {
        let (b, s, _) = x.dims3()?;
        let f = self.params.get(gate).block.shape[0];
        if self.fp8_at(layer).is_some() {
            let [g, u] =
                self.project(layer, x, [(gate, (b, s, f).into()), (up, (b, s, f).into())])?;
            return Ok(GateUp::Apart(g, u));
        }
        let w = self.params.span(&[gate, up])?; // [2f, h]
        Ok(GateUp::Joined(linear_to(x, &w, (b, s, w.dim(0)?))?)) // [b, s, 2f/tp]
    }

    /// The backward of [`Llama::gate_up`] and the SwiGLU after it, for the activation's
    /// gradient `dact` `[b, s, f/tp]`: the input's gradient (up's contribution plus gate's) and
    /// `[gate, up]`'s weight gradients as factors (joined: each its columns of the joined
    /// gradient, read in place).
    pub(super) fn gate_up_bwd(
        &self,
        layer: usize,
        x: &Tensor,
        [gate, up]: [usize; 2],
        gu: &GateUp,
        dact: &Tensor,
    ) -> Result<(Tensor, [(usize, ParamGrad); 2])> {
        match gu {
            GateUp::Apart(g, u) => {
                let (dgate, dup) = ops::swiglu_bwd(g, u, dact)?;
                let (dx, [d_up, d_gate]) =
                    self.project_bwd(layer, x, [(up, &dup), (gate, &dgate)])?;
                Ok((dx, [d_gate, d_up]))
            }
            GateUp::Joined(gu) => {
                let w = self.params.span(&[gate, up])?; // [2f, h]
                let (two_f, n_in) = w.dims2()?;
                let rows = x.elem_count() / n_in.max(1);
                let dgu = ops::swiglu_joined_bwd(gu, dact)?.reshape((rows, two_f))?; // [rows, 2f]
                let dx = ops::linear_dx(&w, &dgu, x.shape())?; // x's shape
                let x2 = x.reshape((rows, n_in))?; // [rows, h]
                let f = two_f / 2;
                let factor = |at: usize| -> Result<ParamGrad> {
                    let g = dgu.narrow(1, at, f)?; // [rows, f], rows 2f apart
                    Ok(ParamGrad::Product { g, x: x2.clone() })
                };
                Ok((dx, [(gate, factor(0)?), (up, factor(f)?)]))
            }
        }
    }

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
            None if N == 1 => {
                for (i, shape) in outs {
                    ys.push(linear_to(x, &self.w(i)?, shape)?);
                }
            }
            None => {
                let ids = outs.each_ref().map(|(i, _)| *i);
                let w = self.params.span(&ids)?; // [Σ out, in]
                let (total, n_in) = w.dims2()?;
                let rows = x.elem_count() / n_in.max(1);
                let y = linear_to(x, &w, (rows, total))?; // [rows, Σ out]
                let mut at = 0;
                for (i, shape) in outs {
                    let n = self.params.get(i).block.shape[0];
                    ys.push(y.narrow(1, at, n)?.contiguous()?.reshape(shape)?); // [.., out]
                    at += n;
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
    /// gradient (one GEMM over the stacked weights in the model dtype; in FP8 the linears'
    /// contributions summed in `gs`'s order), and each weight's gradient as its factors (the
    /// input's rounding along the tokens shared, in FP8).
    pub(super) fn project_bwd<const N: usize>(
        &self,
        layer: usize,
        x: &Tensor,
        gs: [(usize, &Tensor); N],
    ) -> Result<(Tensor, [(usize, ParamGrad); N])> {
        if N > 1 && self.fp8_at(layer).is_none() {
            return self.fused_bwd(x, gs);
        }
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

    /// [`Llama::project_bwd`] of linears sharing an input, in the model dtype: `dx` as one
    /// GEMM of the upstream gradients side by side `[rows, Σ out]` and the weights stacked in
    /// parameter order (how they are packed).
    fn fused_bwd<const N: usize>(
        &self,
        x: &Tensor,
        gs: [(usize, &Tensor); N],
    ) -> Result<(Tensor, [(usize, ParamGrad); N])> {
        let mut order = gs.to_vec();
        order.sort_by_key(|&(i, _)| i);
        let ids: Vec<usize> = order.iter().map(|&(i, _)| i).collect();
        let w = self.params.span(&ids)?; // [Σ out, in]
        let (total, n_in) = w.dims2()?;
        let rows = x.elem_count() / n_in.max(1);
        let parts = order
            .iter()
            .map(|&(i, g)| g.reshape((rows, self.params.get(i).block.shape[0])))
            .collect::<Result<Vec<_>>>()?;
        let g = Tensor::cat(&parts, 1)?; // [rows, Σ out]
        debug_assert_eq!(g.dim(1)?, total);
        let dx = ops::linear_dx(&w, &g, x.shape())?; // x's shape
        let mut grads = Vec::with_capacity(N);
        for (i, g) in gs {
            let (g, x) = ops::linear_factors(x, &self.w(i)?, g)?;
            grads.push((i, ParamGrad::Product { g, x }));
        }
        let grads = grads
            .try_into()
            .unwrap_or_else(|_| unreachable!("one per linear"));
        Ok((dx, grads))
    }
}
