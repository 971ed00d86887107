//! `linear`: `y = x · wᵀ` for a weight stored `[out, in]` (Hugging Face's layout) as one
//! differentiable op.
//!
//! Written with candle's primitives, the product is four graph nodes (reshape of `x` to rows,
//! transpose of `w`, matmul, reshape back), and candle's backward materialises a zero gradient
//! and adds into it for every edge of the graph: five full-size additions per linear, one of them
//! reading the transposed weight gradient with strides (slow on a GPU). As one op the graph has
//! two edges (`x` and `w`). The forward and `dx` are the GEMM calls candle's nodes made; `dw` is
//! computed as `gᵀ · x` straight into the weight's `[out, in]` layout instead of `(xᵀ · g)ᵀ`, the
//! same dot products (bit-identical on the CPU, tested; on a GPU cuBLAS may pick another kernel).

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

const OP: &str = "linear";

/// The product's geometry: rows, `in`, `out`, the layouts of `x` as `[rows, in]` and of `wᵀ` as
/// `[in, out]`.
struct Geometry {
    rows: usize,
    n_in: usize,
    n_out: usize,
    x2: Layout,
    wt: Layout,
}

fn geometry(lx: &Layout, lw: &Layout) -> Result<Geometry> {
    let (n_out, n_in) = match lw.dims() {
        &[o, i] => (o, i),
        d => bail!("{OP}: w must be [out, in], got {d:?}"),
    };
    let n = lx.shape().elem_count();
    if n_in == 0 || !n.is_multiple_of(n_in) {
        bail!(
            "{OP}: x {:?} is not a whole number of rows of the {n_in} features of w [{n_out}, {n_in}]",
            lx.dims()
        );
    }
    if !lx.is_contiguous() {
        bail!("{OP}: x must be contiguous (the wrapper makes it so)");
    }
    let rows = n / n_in;
    Ok(Geometry {
        rows,
        n_in,
        n_out,
        x2: Layout::contiguous_with_offset((rows, n_in), lx.start_offset()),
        wt: lw.transpose(0, 1)?,
    })
}

/// `x · wᵀ` with the output in `shape` (`rows × out` elements).
struct Linear {
    shape: Shape,
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = geometry(lx, lw)?;
        let y = sx.matmul(sw, (1, g.rows, g.n_out, g.n_in), &g.x2, &g.wt)?; // [rows, out]
        Ok((y, self.shape.clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let g = geometry(lx, lw)?;
        let y = sx.matmul(sw, (1, g.rows, g.n_out, g.n_in), &g.x2, &g.wt)?; // [rows, out]
        Ok((y, self.shape.clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = linear_bwd(x, w, grad)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Gradients `(dx, dw)` of `x · wᵀ` for the upstream gradient `grad`: `dx = g · w` in `x`'s
/// shape and `dw = gᵀ · x` `[out, in]` (the op's backward).
pub(super) fn linear_bwd(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    let (g, x2) = linear_factors(x, w, grad)?;
    let dx = linear_dx(w, grad, x.shape())?; // x's shape
    let dw = g.t()?.matmul(&x2)?; // [out, in]
    Ok((dx, dw))
}

/// See [`super::linear_dx`].
pub(super) fn linear_dx(w: &Tensor, grad: &Tensor, shape: &Shape) -> Result<Tensor> {
    let n_out = w.dim(0)?;
    let g = grad.reshape((grad.elem_count() / n_out.max(1), n_out))?; // [rows, out]
    g.matmul(&w.detach())?.reshape(shape)
}

/// See [`super::linear_factors`].
pub(super) fn linear_factors(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    let (n_out, n_in) = w.dims2()?;
    let rows = x.elem_count() / n_in.max(1);
    let g = grad.reshape((rows, n_out))?; // [rows, out]
    let x2 = x.detach().reshape((rows, n_in))?; // [rows, in]
    Ok((g, x2))
}

pub(super) fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let mut shape = x.dims().to_vec();
    match (shape.last_mut(), w.dims()) {
        (Some(last), &[n_out, n_in]) if *last == n_in => *last = n_out,
        (Some(last), &[n_out, n_in]) => {
            bail!("{OP}: x has {last} features but w is [{n_out}, {n_in}]")
        }
        _ => bail!(
            "{OP}: expected x [.., in] and w [out, in], got {:?} and {:?}",
            x.dims(),
            w.dims()
        ),
    }
    linear_to(x, w, shape)
}

pub(super) fn linear_to(x: &Tensor, w: &Tensor, shape: impl Into<Shape>) -> Result<Tensor> {
    let shape = shape.into();
    let (n_out, n_in) = w.dims2()?;
    let rows = x.elem_count() / n_in.max(1);
    if shape.elem_count() != rows * n_out {
        bail!(
            "{OP}: output shape {shape:?} does not hold the {rows} x {n_out} products of x {:?} \
             and w [{n_out}, {n_in}]",
            x.dims()
        );
    }
    x.contiguous()?.apply_op2(w, Linear { shape })
}
