//! FP8 GEMMs of a linear: the forward `y = x · wᵀ`, the input gradient `dx = g · w` and the
//! weight gradient `dw += gᵀ · x` with FP8 operands, scaled per tensor or by blocks. On CUDA each
//! is one cuBLASLt matmul on FP8 codes with the operands' inverse scales as its scale pointers
//! (`cuda/lt.rs`). On the CPU each multiplies the operands' rounded values with the model
//! dtype's GEMM, the same values the FP8 GEMM multiplies, so the two differ only in the order
//! of the sums.
//!
//! Hopper's FP8 GEMMs take both operands K-major ("TN"): the contraction dimension contiguous.
//! [`LtGemm`] says how each product maps onto cuBLASLt's column-major `D = op(A) · op(B)` with
//! `op(A)` transposed and `op(B)` not, and which operand needs its codes transposed:
//!
//! | product | D (column-major)     | A (transposed)       | B                    | K    |
//! |---------|----------------------|----------------------|----------------------|------|
//! | forward | `yᵀ` `[out, rows]`   | `w` codes            | `x` codes            | in   |
//! | dx      | `dxᵀ` `[in, rows]`   | `wᵀ` codes           | `g` codes            | out  |
//! | dw      | `dwᵀ` `[in, out]`    | `xᵀ` codes           | `gᵀ` codes           | rows |
//!
//! Inputs and weights are E4M3, gradients E5M2 (cuBLASLt multiplies E4M3 by E5M2, not E5M2 by
//! E5M2). The forward accumulates fast (`FAST_ACCUM`), the two gradients do not, as Transformer
//! Engine does. The weight gradient accumulates into the f32 gradient buffer (`beta = 1`).

use candle_core::{bail, CpuStorage, CustomOp2, InplaceOp3, Layout, Result, Shape, Tensor};

use super::operand::{fp8_add_product_of, fp8_linear_dx_of, fp8_linear_of, Fp8Operand};
use super::packing::{LtScale, Packing};
use super::{fp8_round, Fp8Blocks, Fp8Format, Fp8Quant};

/// A matrix as cuBLASLt reads it: column-major `rows × cols` with leading dimension `ld`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LtMatrix {
    pub rows: u64,
    pub cols: u64,
    pub ld: u64,
}

impl LtMatrix {
    /// A row-major `[r, c]` tensor, which column-major reads as `c × r`.
    fn row_major(r: usize, c: usize) -> Self {
        LtMatrix {
            rows: c as u64,
            cols: r as u64,
            ld: c as u64,
        }
    }
}

/// What D holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LtOut {
    /// bf16, overwritten (`beta = 0`).
    Bf16,
    /// f32, accumulated into (`beta = 1`, C = D).
    AccumulateF32,
}

/// One FP8 matmul `D = a_scale · b_scale · op(A) · op(B) (+ D)` with `op(A) = Aᵀ` and
/// `op(B) = B`: `m × n` from a contraction of `k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LtGemm {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// As stored: `k × m` (read transposed).
    pub a: LtMatrix,
    /// As stored: `k × n`.
    pub b: LtMatrix,
    /// `m × n`.
    pub d: LtMatrix,
    pub a_format: Fp8Format,
    pub b_format: Fp8Format,
    pub out: LtOut,
    pub fast_accum: bool,
    /// How A and B are scaled (one scale each, unless [`LtGemm::scaled`] says).
    pub a_scale: LtScale,
    pub b_scale: LtScale,
}

impl LtGemm {
    /// `y [rows, out] = x [rows, inp] · w [out, inp]ᵀ`: A = `w`'s codes, B = `x`'s.
    pub fn forward(rows: usize, out: usize, inp: usize) -> Self {
        LtGemm {
            m: out as u64,
            n: rows as u64,
            k: inp as u64,
            a: LtMatrix::row_major(out, inp),
            b: LtMatrix::row_major(rows, inp),
            d: LtMatrix::row_major(rows, out),
            a_format: Fp8Format::E4M3,
            b_format: Fp8Format::E4M3,
            out: LtOut::Bf16,
            fast_accum: true,
            a_scale: LtScale::Scalar,
            b_scale: LtScale::Scalar,
        }
    }

    /// `dx [rows, inp] = g [rows, out] · w [out, inp]`: A = `wᵀ`'s codes `[inp, out]`, B = `g`'s.
    pub fn input_grad(rows: usize, out: usize, inp: usize) -> Self {
        LtGemm {
            m: inp as u64,
            n: rows as u64,
            k: out as u64,
            a: LtMatrix::row_major(inp, out),
            b: LtMatrix::row_major(rows, out),
            d: LtMatrix::row_major(rows, inp),
            a_format: Fp8Format::E4M3,
            b_format: Fp8Format::E5M2,
            out: LtOut::Bf16,
            fast_accum: false,
            a_scale: LtScale::Scalar,
            b_scale: LtScale::Scalar,
        }
    }

    /// `dw [out, inp] += g [rows, out]ᵀ · x [rows, inp]`: A = `xᵀ`'s codes `[inp, rows]`, B =
    /// `gᵀ`'s `[out, rows]`.
    pub fn weight_grad(rows: usize, out: usize, inp: usize) -> Self {
        LtGemm {
            m: inp as u64,
            n: out as u64,
            k: rows as u64,
            a: LtMatrix::row_major(inp, rows),
            b: LtMatrix::row_major(out, rows),
            d: LtMatrix::row_major(out, inp),
            a_format: Fp8Format::E4M3,
            b_format: Fp8Format::E5M2,
            out: LtOut::AccumulateF32,
            fast_accum: false,
            a_scale: LtScale::Scalar,
            b_scale: LtScale::Scalar,
        }
    }

    /// The plan with A and B scaled as `a` and `b` say (block-scaled GEMMs accumulate
    /// without `FAST_ACCUM`, which cuBLASLt's block scaling does not take).
    pub fn scaled(self, a: LtScale, b: LtScale) -> Self {
        let scalar = a == LtScale::Scalar && b == LtScale::Scalar;
        LtGemm {
            a_scale: a,
            b_scale: b,
            fast_accum: self.fast_accum && scalar,
            ..self
        }
    }
}

/// One scale for the whole operand.
const TENSOR: Option<Fp8Blocks> = Some(Fp8Blocks::Tensor);

/// Tensorwise rounding in `format`.
fn tensorwise(format: Fp8Format) -> Fp8Quant {
    Fp8Quant {
        format,
        blocks: Fp8Blocks::Tensor,
    }
}

/// `x · wᵀ` in `shape` with both operands in E4M3, tensorwise (`x` holds rows of `w`'s `in`),
/// each quantized for this one GEMM.
pub fn fp8_linear(x: &Tensor, w: &Tensor, shape: impl Into<Shape>) -> Result<Tensor> {
    let inp = w.dim(1)?;
    let xq = Fp8Operand::codes(x, inp, Fp8Format::E4M3, (TENSOR, None))?;
    let wq = Fp8Operand::codes(w, inp, Fp8Format::E4M3, (TENSOR, None))?;
    fp8_linear_of(&xq, &wq, shape)
}

/// `g · w` in `shape` (`x`'s) with `g` in E5M2 and `w` in E4M3, tensorwise, each quantized
/// for this one GEMM.
pub fn fp8_linear_dx(w: &Tensor, g: &Tensor, shape: &Shape) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    let wq = Fp8Operand::codes(w, inp, Fp8Format::E4M3, (None, TENSOR))?;
    let gq = Fp8Operand::codes(g, out, Fp8Format::E5M2, (TENSOR, None))?;
    fp8_linear_dx_of(&wq, &gq, shape)
}

/// The forward's FP8 GEMM on CUDA codes: `[rows, out]` bf16.
pub(super) fn on_cuda_forward(
    x: &Fp8Operand,
    w: &Fp8Operand,
    dims: (usize, usize, usize),
) -> Result<Tensor> {
    let ((xp, xk), (wp, wk)) = (packed(x)?, packed(w)?);
    let op = OnCuda {
        product: Product::Forward,
        dims,
        packings: (xk, wk),
    };
    xp.apply_op2_no_bwd(wp, &op)
}

/// The input gradient's FP8 GEMM on CUDA codes: `[rows, in]` bf16.
pub(super) fn on_cuda_input_grad(
    w: &Fp8Operand,
    g: &Fp8Operand,
    dims: (usize, usize, usize),
) -> Result<Tensor> {
    let ((wp, wk), (gp, gk)) = (packed(w)?, packed(g)?);
    let op = OnCuda {
        product: Product::InputGrad,
        dims,
        packings: (wk, gk),
    };
    wp.apply_op2_no_bwd(gp, &op)
}

fn packed(o: &Fp8Operand) -> Result<(&Tensor, Packing)> {
    match o.packed() {
        Some(p) => Ok(p),
        None => bail!("fp8 GEMM: an operand of rounded values where codes were expected"),
    }
}

/// The operands of `gᵀ · x` as the FP8 weight gradient multiplies them on the CPU: `g`
/// `[rows, out]` in E5M2 and `x` `[rows, in]` in E4M3, tensorwise.
pub fn fp8_product_factors(g: &Tensor, x: &Tensor) -> Result<(Tensor, Tensor)> {
    Ok((
        fp8_round(g, tensorwise(Fp8Format::E5M2))?,
        fp8_round(x, tensorwise(Fp8Format::E4M3))?,
    ))
}

/// `dst += gᵀ · x` as one FP8 GEMM on CUDA (`dst` an f32 view of `out × in` elements, `g`
/// `[rows, out]`, `x` `[rows, in]`, bf16), each factor quantized (transposed) for this one
/// GEMM: cuBLASLt accumulating into `dst`. Elsewhere the gradient buffer multiplies
/// [`fp8_product_factors`] with its own kernel; here it is an error.
pub fn fp8_add_product_into(dst: &Tensor, g: &Tensor, x: &Tensor) -> Result<()> {
    let (out, inp) = (g.dim(1)?, x.dim(1)?);
    let gq = Fp8Operand::codes(g, out, Fp8Format::E5M2, (None, TENSOR))?;
    let xq = Fp8Operand::codes(x, inp, Fp8Format::E4M3, (None, TENSOR))?;
    fp8_add_product_of(dst, &gq, &xq)
}

/// The weight gradient's FP8 GEMM on CUDA codes, accumulated into `dst`.
pub(super) fn on_cuda_weight_grad(
    dst: &Tensor,
    g: &Fp8Operand,
    x: &Fp8Operand,
    dims: (usize, usize, usize),
) -> Result<()> {
    let ((gp, gk), (xp, xk)) = (packed(g)?, packed(x)?);
    let op = OnCuda {
        product: Product::WeightGrad,
        dims,
        packings: (gk, xk),
    };
    dst.inplace_op3(gp, xp, &op)
}

/// One of the three products as an op on CUDA storage (`cuda/lt.rs`), with `(rows, out, inp)`
/// of the linear and, for the forward and the input gradient, the packings of its two packed
/// operands (in the op's argument order).
struct OnCuda {
    product: Product,
    dims: (usize, usize, usize),
    packings: (Packing, Packing),
}

#[derive(Debug)]
enum Product {
    Forward,
    InputGrad,
    WeightGrad,
}

impl OnCuda {
    fn cpu_refused<T>(&self) -> Result<T> {
        bail!(
            "FP8 GEMM ({:?}, rows x out x in = {:?}, packed {:?}): FP8 GEMMs run on CUDA; on \
             the CPU the operands are rounded and multiplied instead",
            self.product,
            self.dims,
            self.packings
        )
    }
}

impl CustomOp2 for OnCuda {
    fn name(&self) -> &'static str {
        "fp8-gemm"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu_refused()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::super::cuda::lt;
        let (rows, out, inp) = self.dims;
        let (p1, p2) = self.packings;
        // Forward: s1 = x, s2 = w (A = w's codes, B = x's); input gradient: s1 = w, s2 = g
        // (A = w's transposed codes, B = g's).
        match self.product {
            Product::Forward => Ok((
                lt::product(
                    LtGemm::forward(rows, out, inp),
                    (((s2, l2), p2), false),
                    (((s1, l1), p1), false),
                )?,
                (rows, out).into(),
            )),
            Product::InputGrad => Ok((
                lt::product(
                    LtGemm::input_grad(rows, out, inp),
                    (((s1, l1), p1), true),
                    (((s2, l2), p2), false),
                )?,
                (rows, inp).into(),
            )),
            Product::WeightGrad => bail!("fp8-gemm: the weight gradient is in place"),
        }
    }
}

impl InplaceOp3 for OnCuda {
    fn name(&self) -> &'static str {
        "fp8-add-product"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        self.cpu_refused()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        x: &candle_core::CudaStorage,
        xl: &Layout,
    ) -> Result<()> {
        match self.product {
            Product::WeightGrad => super::super::cuda::lt::add_product(
                (dst, dl),
                (g, gl),
                (x, xl),
                self.packings,
                self.dims,
            ),
            _ => bail!("fp8-add-product: only the weight gradient is in place"),
        }
    }
}

#[cfg(test)]
#[path = "gemm_tests.rs"]
mod tests;
