//! `rms_norm`: RMSNorm over the last dimension with a learned weight, and its backward kernel
//! (one pass producing `dx` and the row-summed `dweight`).

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::common::{
    dot, dot3, kernel_dtype, prepare, rows_per_task, same_device, same_dtype, slice, Float,
};

const OP: &str = "rms_norm";

/// Forward: `y = x * r * w` per row, `r = 1 / sqrt(mean(x²) + eps)`.
struct RmsNorm {
    eps: f64,
}

/// `1 / sqrt(mean(row²) + eps)`, accumulated in `T`.
#[inline]
fn inv_rms<T: Float>(row: &[T], eps: T) -> T {
    let sumsq = dot(row, row);
    let h = T::from(row.len()).unwrap_or_else(T::one);
    T::one() / (sumsq / h + eps).sqrt()
}

impl RmsNorm {
    fn fwd<T: Float>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<CpuStorage> {
        let x = slice::<T>(OP, "x", s1, l1)?; // [n, h]
        let w = slice::<T>(OP, "weight", s2, l2)?; // [h]
        let h = w.len();
        let eps = T::from_f64(self.eps);
        let mut y = vec![T::zero(); x.len()]; // [n, h]
        let chunk = rows_per_task(h) * h;
        y.par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk))
            .for_each(|(y, x)| {
                for (y, x) in y.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
                    let r = inv_rms(x, eps);
                    for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                        *y = x * r * w;
                    }
                }
            });
        Ok(T::to_cpu_storage_owned(y))
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match s1 {
            CpuStorage::F32(_) => self.fwd::<f32>(s1, l1, s2, l2)?,
            CpuStorage::F64(_) => self.fwd::<f64>(s1, l1, s2, l2)?,
            s => bail!("{OP}: unsupported dtype {:?}", s.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::pointwise::rms_norm_fwd(s1, l1, s2, l2, self.eps)?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        // Flat [n * h + h]: dx rows followed by dweight.
        let flat = x.apply_op3_no_bwd(w, &grad, &RmsNormBwd { eps: self.eps })?;
        let nx = x.elem_count();
        let dx = flat.narrow(0, 0, nx)?.reshape(x.shape())?;
        let dw = flat.narrow(0, nx, w.elem_count())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Backward kernel on `(x, weight, grad)`. Per row, with `a = Σ_k g_k w_k x_k`:
/// `dx_j = r g_j w_j - x_j r³ a / h` and `dweight_j = Σ_rows g_j x_j r`.
/// Returns the flat `[n * h + h]` concatenation of `dx` and `dweight`.
struct RmsNormBwd {
    eps: f64,
}

impl RmsNormBwd {
    #[allow(clippy::too_many_arguments)]
    fn bwd<T: Float>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<CpuStorage> {
        let x = slice::<T>(OP, "x", s1, l1)?; // [n, h]
        let w = slice::<T>(OP, "weight", s2, l2)?; // [h]
        let g = slice::<T>(OP, "grad", s3, l3)?; // [n, h]
        let h = w.len();
        let nx = x.len();
        let eps = T::from_f64(self.eps);
        let hf = T::from(h).unwrap_or_else(T::one);
        let mut out = vec![T::zero(); nx + h];
        let (dx, dw) = out.split_at_mut(nx);
        // Fixed chunking (independent of the thread count) keeps the dweight sum deterministic.
        let chunk = rows_per_task(h) * h;
        let partials: Vec<Vec<T>> = dx
            .par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk).zip(g.par_chunks(chunk)))
            .map(|(dx, (x, g))| {
                let mut dw = vec![T::zero(); h]; // [h]
                for ((dx, x), g) in dx
                    .chunks_exact_mut(h)
                    .zip(x.chunks_exact(h))
                    .zip(g.chunks_exact(h))
                {
                    let r = inv_rms(x, eps);
                    let a = dot3(g, w, x);
                    let c = r * r * r * a / hf;
                    for j in 0..h {
                        dx[j] = r * g[j] * w[j] - x[j] * c;
                        dw[j] += g[j] * x[j] * r;
                    }
                }
                dw
            })
            .collect();
        for p in &partials {
            for (d, &v) in dw.iter_mut().zip(p) {
                *d += v;
            }
        }
        Ok(T::to_cpu_storage_owned(out))
    }
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "rms_norm-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match s1 {
            CpuStorage::F32(_) => self.bwd::<f32>(s1, l1, s2, l2, s3, l3)?,
            CpuStorage::F64(_) => self.bwd::<f64>(s1, l1, s2, l2, s3, l3)?,
            s => bail!("{OP}: unsupported dtype {:?}", s.dtype()),
        };
        let len = l1.shape().elem_count() + l2.shape().elem_count();
        Ok((out, Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::pointwise::rms_norm_bwd(s1, l1, s2, l2, s3, l3, self.eps)?;
        let len = l1.shape().elem_count() + l2.shape().elem_count();
        Ok((out, Shape::from(len)))
    }
}

/// See [`super::rms_norm`].
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let h = match x.dims().last() {
        Some(&h) => h,
        None => bail!("{OP}: `x` must have at least one dimension, got a scalar"),
    };
    if weight.dims() != [h] {
        bail!(
            "{OP}: `weight` must have shape [{h}] (the last dim of `x` {:?}), got {:?}",
            x.dims(),
            weight.dims()
        )
    }
    if h == 0 {
        bail!("{OP}: the last dim of `x` {:?} must be non-zero", x.dims())
    }
    if eps.is_nan() || eps < 0.0 {
        bail!("{OP}: `eps` must be non-negative, got {eps}")
    }
    same_dtype(OP, ("x", x), ("weight", weight))?;
    same_device(OP, ("x", x), ("weight", weight))?;
    let dtype = x.dtype();
    let cdt = kernel_dtype(OP, "x", x)?;
    let y = prepare(x, cdt)?.apply_op2(&prepare(weight, cdt)?, RmsNorm { eps })?;
    y.to_dtype(dtype)
}

/// See [`super::rms_norm_bwd`].
pub fn rms_norm_bwd(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    dy: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (dtype, cdt) = (x.dtype(), kernel_dtype(OP, "x", x)?);
    let (xc, wc) = (prepare(x, cdt)?, prepare(weight, cdt)?);
    let (dx, dw) = RmsNorm { eps }.bwd(&xc, &wc, &xc, &dy.to_dtype(cdt)?)?;
    match (dx, dw) {
        (Some(dx), Some(dw)) => Ok((dx.to_dtype(dtype)?, dw.to_dtype(weight.dtype())?)),
        _ => bail!("{OP}: the backward kernel gave no gradient"),
    }
}
