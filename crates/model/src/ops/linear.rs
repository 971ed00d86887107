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
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, D};

const OP: &str = "linear";

/// The product's geometry: rows, `in`, `out`, the output shape, the layouts of `x` as `[rows,
/// in]` and of `wᵀ` as `[in, out]`.
struct Geometry {
    rows: usize,
    n_in: usize,
    n_out: usize,
    shape: Shape,
    x2: Layout,
    wt: Layout,
}

fn geometry(lx: &Layout, lw: &Layout) -> Result<Geometry> {
    let xd = lx.dims();
    let (n_in, n_out, w_in) = match (xd.last(), lw.dims()) {
        (Some(&n_in), &[n_out, w_in]) => (n_in, n_out, w_in),
        _ => bail!(
            "{OP}: expected x [.., in] and w [out, in], got {xd:?} and {:?}",
            lw.dims()
        ),
    };
    if w_in != n_in {
        bail!("{OP}: x has {n_in} features but w is [{n_out}, {w_in}]");
    }
    if !lx.is_contiguous() {
        bail!("{OP}: x must be contiguous (the wrapper makes it so)");
    }
    let rows = lx.shape().elem_count() / n_in.max(1);
    let mut out = xd.to_vec();
    if let Some(last) = out.last_mut() {
        *last = n_out;
    }
    Ok(Geometry {
        rows,
        n_in,
        n_out,
        shape: Shape::from(out),
        x2: Layout::contiguous_with_offset((rows, n_in), lx.start_offset()),
        wt: lw.transpose(0, 1)?,
    })
}

struct Linear;

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
        Ok((y, g.shape))
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
        Ok((y, g.shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n_in, n_out) = (x.dim(D::Minus1)?, w.dim(0)?);
        let rows = x.elem_count() / n_in.max(1);
        let g = grad.reshape((rows, n_out))?; // [rows, out]
        let x2 = x.detach().reshape((rows, n_in))?; // [rows, in]
        let dx = g.matmul(&w.detach())?.reshape(x.shape())?; // [.., in]
        let dw = g.t()?.matmul(&x2)?; // [out, in]
        Ok((Some(dx), Some(dw)))
    }
}

pub(super) fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(w, Linear)
}
