//! The block's seven linears (q, k, v, o, gate, up, down) in FP8, emulated: each GEMM's operands
//! are rounded to FP8 as an FP8 GEMM would read them ([`ops::fp8_round`]), then multiplied by the
//! ordinary GEMM. The numerics are FP8 training's (recipes as Transformer Engine's and
//! DeepSeek-V3's); the speed is not: the rounding passes come on top of bf16 GEMMs.
//!
//! Per linear `y = x · wᵀ`:
//! - forward: `x` and `w` in E4M3;
//! - input gradient `dx = g · w`: `g` in E5M2 (its range needs the wider exponent), `w` as in
//!   the forward;
//! - weight gradient `dw = gᵀ · x`: `g` in E5M2 and `x` in E4M3, both scaled along the tokens
//!   (the GEMM's contraction), accumulated in f32 by the gradient buffer as ever.
//!
//! Scaling ([`Fp8Scaling`]): `tensorwise` gives each operand one scale from its current amax;
//! `blockwise` scales activations and gradients per 1 × 128 run along the contraction (128 × 1
//! for the weight gradient's operands) and weights per 128 × 128 tile. The embedding, the head,
//! norms, attention, the router and the experts stay in the model dtype, and so do master
//! weights, optimizer states and checkpoints.
//!
//! Tensor parallelism rounds each rank's shard: a sharded weight's tensorwise scale is its
//! shard's, so tensorwise results differ from one rank's by rounding; with `blockwise` and shards
//! that are whole multiples of 128, every block is the single rank's.

use std::ops::Range;

use candle_core::{Result, Tensor};

use crate::ops::{self, Fp8Blocks, Fp8Format, Fp8Operand, Fp8Quant};
use crate::segment::ParamGrad;

/// How FP8 linears scale their operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// One scale per tensor, from its current amax.
    Tensorwise,
    /// 1 × 128 for activations and gradients, 128 × 128 for weights.
    Blockwise,
}

/// What multiplies the rounded operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Gemm {
    /// The model dtype's GEMM, on the operands' rounded values (any device).
    Emulated,
    /// FP8 GEMMs on their codes (cuBLASLt on CUDA, block-scaled under blockwise scaling; the
    /// CPU multiplies the same rounded values as `Emulated`).
    CublasLt,
}

/// Which blocks run their linears in FP8, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Linears {
    pub scaling: Fp8Scaling,
    pub gemm: Fp8Gemm,
    /// Global layer indices (the first and last blocks are usually left out).
    pub layers: Range<usize>,
}

impl super::Llama {
    /// Runs the linears of the blocks `fp8` names in FP8; a new model runs none.
    pub fn set_fp8(&mut self, fp8: Option<Fp8Linears>) {
        self.fp8 = fp8;
    }

    /// How layer `layer`'s linears run in FP8; `None`: in the model dtype.
    pub fn fp8_at(&self, layer: usize) -> Option<(Fp8Scaling, Fp8Gemm)> {
        self.fp8
            .as_ref()
            .filter(|f| f.layers.contains(&layer))
            .map(|f| (f.scaling, f.gemm))
    }
}

/// An operand's role in a linear's three GEMMs.
#[derive(Clone, Copy)]
enum Operand {
    /// `x` `[rows, in]` in the forward: contraction along `in`.
    Input,
    /// `w` `[out, in]`, in the forward and the input gradient.
    Weight,
    /// `g` `[rows, out]` in the input gradient: contraction along `out`.
    Grad,
    /// `g` `[rows, out]` in the weight gradient: contraction along the rows.
    GradByToken,
    /// `x` `[rows, in]` in the weight gradient: contraction along the rows.
    InputByToken,
}

impl Fp8Scaling {
    fn quant(self, operand: Operand) -> Fp8Quant {
        let format = match operand {
            Operand::Grad | Operand::GradByToken => Fp8Format::E5M2,
            _ => Fp8Format::E4M3,
        };
        let blocks = match (self, operand) {
            (Fp8Scaling::Tensorwise, _) => Fp8Blocks::Tensor,
            (Fp8Scaling::Blockwise, Operand::Input | Operand::Grad) => Fp8Blocks::Rows,
            (Fp8Scaling::Blockwise, Operand::Weight) => Fp8Blocks::Tiles,
            (Fp8Scaling::Blockwise, Operand::GradByToken | Operand::InputByToken) => {
                Fp8Blocks::Cols
            }
        };
        Fp8Quant { format, blocks }
    }

    /// `t` read as rows of its `cols` features, rounded as `operand` is, in `t`'s shape.
    fn round(self, t: &Tensor, cols: usize, operand: Operand) -> Result<Tensor> {
        let rows = t.elem_count() / cols.max(1);
        let r = ops::fp8_round(&t.reshape((rows, cols))?, self.quant(operand))?; // [rows, cols]
        r.reshape(t.shape())
    }
}

/// How a block's linears run in FP8: their scaling and what multiplies.
pub type Fp8Mode = (Fp8Scaling, Fp8Gemm);

/// A weight `[out, in]` as both its GEMMs read it (E4M3; 128 × 128 tiles under blockwise): its
/// rounded values, or with FP8 GEMMs its codes as laid out (the forward's) and transposed (the
/// input gradient's). The model keeps it for the step (`Parameter::fp8_operand`).
pub fn weight_operand(w: &Tensor, (s, gemm): Fp8Mode) -> Result<Fp8Operand> {
    let (n_in, q) = (w.dim(1)?, s.quant(Operand::Weight));
    match gemm {
        Fp8Gemm::CublasLt => Fp8Operand::codes(w, n_in, q.format, (Some(q.blocks), Some(q.blocks))),
        Fp8Gemm::Emulated => Fp8Operand::values(w, n_in, q),
    }
}

/// A linear's input `x` (rows of `cols`) as its forward reads it: E4M3 (1 × 128 blocks under
/// blockwise). The linears that read one input (q, k, v; gate, up) share it.
pub fn input_operand(x: &Tensor, cols: usize, mode: Fp8Mode) -> Result<Fp8Operand> {
    operand(x, cols, mode, Operand::Input, false)
}

/// An upstream gradient `g` (rows of `cols`) as the input gradient's GEMM reads it (E5M2; 1 ×
/// 128 blocks under blockwise); with FP8 GEMMs and one tensor scale, its codes also transposed,
/// the weight gradient's, from the same pass.
fn grad_operand(g: &Tensor, cols: usize, mode: Fp8Mode) -> Result<Fp8Operand> {
    match mode {
        (Fp8Scaling::Tensorwise, Fp8Gemm::CublasLt) => {
            let tensor = Some(Fp8Blocks::Tensor);
            Fp8Operand::codes(g, cols, Fp8Format::E5M2, (tensor, tensor))
        }
        _ => operand(g, cols, mode, Operand::Grad, false),
    }
}

/// The input `x` (rows of `cols`) as the weight gradient's factor, rounded along the tokens:
/// shared by the linears that read it (with FP8 GEMMs, its transposed codes).
pub fn input_by_token(x: &Tensor, cols: usize, mode: Fp8Mode) -> Result<Fp8Operand> {
    operand(x, cols, mode, Operand::InputByToken, true)
}

/// `t` (rows of `cols`) as `role` rounds it: its values, or with FP8 GEMMs its codes as laid
/// out, or `transposed` (an operand along the tokens).
fn operand(
    t: &Tensor,
    cols: usize,
    (s, gemm): Fp8Mode,
    role: Operand,
    transposed: bool,
) -> Result<Fp8Operand> {
    let q = s.quant(role);
    match (gemm, transposed) {
        (Fp8Gemm::CublasLt, false) => Fp8Operand::codes(t, cols, q.format, (Some(q.blocks), None)),
        (Fp8Gemm::CublasLt, true) => Fp8Operand::codes(t, cols, q.format, (None, Some(q.blocks))),
        (Fp8Gemm::Emulated, _) => Fp8Operand::values(t, cols, q),
    }
}

/// [`ops::linear_to`] with both operands rounded to FP8 (`x` holds rows of `w`'s `in`), each
/// for this one call.
pub fn linear_to(
    x: &Tensor,
    w: &Tensor,
    shape: impl Into<candle_core::Shape>,
    mode: Fp8Mode,
) -> Result<Tensor> {
    let xq = input_operand(x, w.dim(1)?, mode)?;
    ops::fp8_linear_of(&xq, &weight_operand(w, mode)?, shape)
}

/// The backward of [`linear_to`], each operand rounded for this one call.
pub fn projection_bwd(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    mode: Fp8Mode,
) -> Result<(Tensor, ParamGrad)> {
    projection_bwd_of(x, None, &weight_operand(w, mode)?, g, mode)
}

/// The backward of a linear `x · wᵀ` from the weight's operand `wq`: `dx = fp8(g) · fp8(w)`
/// in `x`'s shape and the weight gradient's factors, each rounded along the tokens (`x`'s as
/// `x_by_token` when given, [`input_by_token`]); with FP8 GEMMs the factors' codes, for the
/// gradient buffer's FP8 GEMM ([`ParamGrad::Fp8Product`]).
pub fn projection_bwd_of(
    x: &Tensor,
    x_by_token: Option<&Fp8Operand>,
    wq: &Fp8Operand,
    g: &Tensor,
    mode: Fp8Mode,
) -> Result<(Tensor, ParamGrad)> {
    let (n_out, n_in) = wq.dims();
    let gq = grad_operand(g, n_out, mode)?; // [rows, out]
    let dx = ops::fp8_linear_dx_of(wq, &gq, x.shape())?; // x's shape
    let xq = match x_by_token {
        Some(op) => op.clone(),
        None => input_by_token(x, n_in, mode)?,
    }; // [rows, in]
    let s = match mode {
        (Fp8Scaling::Tensorwise, Fp8Gemm::CublasLt) => {
            return Ok((dx, ParamGrad::Fp8Product { g: gq, x: xq })); // both layouts in gq
        }
        (_, Fp8Gemm::CublasLt) => {
            let gw = operand(g, n_out, mode, Operand::GradByToken, true)?; // 128 × 1 blocks
            return Ok((dx, ParamGrad::Fp8Product { g: gw, x: xq }));
        }
        (s, Fp8Gemm::Emulated) => s,
    };
    let g2 = match (s, gq.rounded()) {
        // One tensor scale serves both GEMMs.
        (Fp8Scaling::Tensorwise, Some(rounded)) => rounded.clone(),
        _ => s.round(&g.reshape(gq.dims())?, n_out, Operand::GradByToken)?,
    };
    let x2 = match xq.rounded() {
        Some(rounded) => rounded.clone(),
        None => candle_core::bail!("an emulated FP8 factor holds codes"),
    };
    Ok((dx, ParamGrad::Product { g: g2, x: x2 }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The FP8 linear's forward and backward equal the plain linear's on operands rounded by
    /// hand, and stay within FP8's rounding of the plain results.
    #[test]
    fn fp8_linears_multiply_rounded_operands() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (2, 130, 256), &dev)?; // [b, s, in]
        let w = Tensor::randn(0f32, 0.05, (384, 256), &dev)?; // [out, in]
        let g = Tensor::randn(0f32, 1e-3, (2, 130, 384), &dev)?; // [b, s, out]
        for s in [Fp8Scaling::Tensorwise, Fp8Scaling::Blockwise] {
            let y = linear_to(&x, &w, (2, 130, 384), (s, Fp8Gemm::Emulated))?;
            let by_hand = ops::linear(
                &s.round(&x, 256, Operand::Input)?,
                &s.round(&w, 256, Operand::Weight)?,
            )?;
            assert_eq!(
                y.flatten_all()?.to_vec1::<f32>()?,
                by_hand.flatten_all()?.to_vec1::<f32>()?
            );
            let exact = ops::linear(&x, &w)?;
            let rel = ((&y - &exact)?.sqr()?.sum_all()?.to_scalar::<f32>()?
                / exact.sqr()?.sum_all()?.to_scalar::<f32>()?)
            .sqrt();
            assert!(rel < 0.05, "{s:?}: forward off by {rel}");
            let (dx, dw) = projection_bwd(&x, &w, &g, (s, Fp8Gemm::Emulated))?;
            let ParamGrad::Product { g: g2, x: x2 } = dw else {
                panic!("a product")
            };
            let (dw, dw_exact) = (
                g2.t()?.matmul(&x2)?,
                g.reshape((260, 384))?
                    .t()?
                    .matmul(&x.reshape((260, 256))?)?,
            );
            let dx_exact = ops::linear_dx(&w, &g, x.shape())?;
            for (got, want, what) in [(&dx, &dx_exact, "dx"), (&dw, &dw_exact, "dw")] {
                let rel = ((got - want)?.sqr()?.sum_all()?.to_scalar::<f32>()?
                    / want.sqr()?.sum_all()?.to_scalar::<f32>()?)
                .sqrt();
                assert!(rel < 0.1, "{s:?}: {what} off by {rel}");
            }
            assert_eq!(dx.dims(), x.dims());
        }
        // bf16 operands work alike.
        let y = linear_to(
            &x.to_dtype(DType::BF16)?,
            &w.to_dtype(DType::BF16)?,
            (2, 130, 384),
            (Fp8Scaling::Blockwise, Fp8Gemm::Emulated),
        )?;
        assert_eq!(y.dtype(), DType::BF16);
        Ok(())
    }

    /// A weight's FP8 operand is made once and read by every later use until the weight's
    /// values change: a new value, a reinstall (ZeRO-3) or another mode makes it anew, and a
    /// release drops it.
    #[test]
    fn a_weights_operand_is_kept_until_its_values_change() -> Result<()> {
        use crate::init::Init;
        use crate::params::{ParamKind, ParamSet, ParamSpec};
        use parallel::tp::TensorParallel;
        let dev = Device::Cpu;
        let mut set = ParamSet::default();
        let spec = ParamSpec {
            name: "model.layers.0.self_attn.q_proj.weight",
            global_shape: &[8, 16],
            kind: ParamKind::Matrix,
            init: Init::Normal { std: 0.02 },
        };
        let i = set.add(spec, 7, &TensorParallel::single(), DType::F32, &dev)?;
        let p = set.get(i);
        let made = std::cell::Cell::new(0);
        let operand = |mode: Fp8Mode| {
            p.fp8_operand(mode, |w| {
                made.set(made.get() + 1);
                weight_operand(w, mode)
            })
        };
        let values = |o: &Fp8Operand| o.rounded().unwrap().flatten_all()?.to_vec1::<f32>();
        let tensorwise = (Fp8Scaling::Tensorwise, Fp8Gemm::Emulated);
        let first = operand(tensorwise)?;
        operand(tensorwise)?;
        assert_eq!(made.get(), 1, "the second read reuses the first operand");
        assert_eq!(p.fp8_bytes(), 8 * 16 * 4);
        let new = Tensor::randn(0f32, 1.0, (8, 16), &dev)?;
        p.set(&new)?;
        let after = operand(tensorwise)?;
        assert_eq!(made.get(), 2, "a new value makes a new operand");
        assert_ne!(values(&after)?, values(&first)?);
        assert_eq!(values(&after)?, values(&weight_operand(&new, tensorwise)?)?);
        operand((Fp8Scaling::Blockwise, Fp8Gemm::Emulated))?;
        assert_eq!(made.get(), 3, "another mode makes its own");
        p.install(&new)?;
        operand(tensorwise)?;
        assert_eq!(made.get(), 4, "a reinstalled weight is quantized anew");
        p.release();
        assert_eq!(p.fp8_bytes(), 0, "a release drops the operand");
        assert!(
            operand(tensorwise).is_err(),
            "a released weight has no operand"
        );
        Ok(())
    }
}
