//! `rms_norm`: RMSNorm over the last dimension with a learned weight, and its backward kernel
//! (one pass producing `dx` and the row-summed `dweight`). Fused with the residual stream around
//! it: `add_rms_norm` adds two tensors and normalises the sum in one pass, and the backward adds
//! the residual stream's gradient to `dx` as it writes it (`rms_norm_bwd_add`). Both give the
//! separate ops' results bit for bit: the sum is rounded to the storage type before it is
//! normalised, and `dx` before the residual gradient is added (as `add` after `rms_norm_bwd`).

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;

use super::common::{
    dot, dot3, held_cpu, kernel_dtype, prepare, rows_per_task, same_device, same_dtype, slice,
    Float,
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
        let out = super::cuda::norm::rms_norm_fwd(s1, l1, s2, l2, self.eps)?;
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
        let bwd = RmsNormBwd {
            eps: self.eps,
            residual: None,
        };
        let flat = x.apply_op3_no_bwd(w, &grad, &bwd)?;
        let nx = x.elem_count();
        let dx = flat.narrow(0, 0, nx)?.reshape(x.shape())?;
        let dw = flat.narrow(0, nx, w.elem_count())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Backward kernel on `(x, weight, grad)`. Per row, with `a = Σ_k g_k w_k x_k`:
/// `dx_j = r g_j w_j - x_j r³ a / h` and `dweight_j = Σ_rows g_j x_j r`; with a `residual`
/// gradient (`[n, h]`, contiguous, of the kernel dtype) `dx_j` is added to it.
/// Returns the flat `[n * h + h]` concatenation of `dx` and `dweight`.
struct RmsNormBwd {
    eps: f64,
    residual: Option<Tensor>,
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
        let held = self.residual.as_ref().map(|t| t.storage_and_layout());
        let res = match &held {
            Some((st, l)) => Some(slice::<T>(
                OP,
                "residual",
                held_cpu(OP, "residual", st)?,
                l,
            )?),
            None => None,
        }; // [n, h]
        let h = w.len();
        let nx = x.len();
        if res.is_some_and(|r| r.len() != nx) {
            bail!("{OP}: the residual gradient is not the shape of `x`")
        }
        let eps = T::from_f64(self.eps);
        let hf = T::from(h).unwrap_or_else(T::one);
        let mut out = vec![T::zero(); nx + h];
        let (dx, dw) = out.split_at_mut(nx);
        // Fixed chunking (independent of the thread count) keeps the dweight sum deterministic.
        let chunk = rows_per_task(h) * h;
        let partials: Vec<Vec<T>> = dx
            .par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk).zip(g.par_chunks(chunk)))
            .enumerate()
            .map(|(task, (dx, (x, g)))| {
                let res = res.map(|r| &r[task * chunk..task * chunk + dx.len()]);
                let mut dw = vec![T::zero(); h]; // [h]
                for (row, ((dx, x), g)) in dx
                    .chunks_exact_mut(h)
                    .zip(x.chunks_exact(h))
                    .zip(g.chunks_exact(h))
                    .enumerate()
                {
                    let r = inv_rms(x, eps);
                    let a = dot3(g, w, x);
                    let c = r * r * r * a / hf;
                    let res = res.map(|res| &res[row * h..(row + 1) * h]);
                    for j in 0..h {
                        let t = r * g[j] * w[j] - x[j] * c;
                        dx[j] = match res {
                            Some(res) => res[j] + t,
                            None => t,
                        };
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
        let held = self.residual.as_ref().map(|t| t.storage_and_layout());
        let res = match &held {
            Some((st, l)) => Some((super::common::held_cuda(OP, "residual", st)?, *l)),
            None => None,
        };
        let (x, w, g) = ((s1, l1), (s2, l2), (s3, l3));
        let out = super::cuda::norm::rms_norm_bwd(x, w, g, res, self.eps)?;
        let len = l1.shape().elem_count() + l2.shape().elem_count();
        Ok((out, Shape::from(len)))
    }
}

/// See [`super::rms_norm`].
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    check(x, weight, eps)?;
    let dtype = x.dtype();
    let cdt = kernel_dtype(OP, "x", x)?;
    let y = prepare(x, cdt)?.apply_op2(&prepare(weight, cdt)?, RmsNorm { eps })?;
    y.to_dtype(dtype)
}

/// Errors unless `weight` is `[h]` for `x`'s last dim `h > 0`, of `x`'s dtype and device, and
/// `eps` is non-negative.
fn check(x: &Tensor, weight: &Tensor, eps: f64) -> Result<()> {
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
    Ok(())
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

/// The residual addition and RMSNorm on the CPU, per row: `s = x + o`, `y = s * r * w` with `r`
/// from the row of `s` (the arithmetic of `add`, then of [`RmsNorm`], on the stored sum).
fn add_norm_cpu<T: Float>(
    (x, xl): (&CpuStorage, &Layout),
    (o, ol): (&CpuStorage, &Layout),
    (w, wl): (&CpuStorage, &Layout),
    eps: f64,
) -> Result<(CpuStorage, CpuStorage)> {
    let x = slice::<T>(OP, "x", x, xl)?; // [n, h]
    let o = slice::<T>(OP, "o", o, ol)?; // [n, h]
    let w = slice::<T>(OP, "weight", w, wl)?; // [h]
    let h = w.len();
    let eps = T::from_f64(eps);
    let (mut sum, mut y) = (vec![T::zero(); x.len()], vec![T::zero(); x.len()]); // [n, h] each
    let chunk = rows_per_task(h) * h;
    sum.par_chunks_mut(chunk)
        .zip(y.par_chunks_mut(chunk))
        .zip(x.par_chunks(chunk).zip(o.par_chunks(chunk)))
        .for_each(|((sum, y), (x, o))| {
            for ((s, y), (x, o)) in (sum.chunks_exact_mut(h).zip(y.chunks_exact_mut(h)))
                .zip(x.chunks_exact(h).zip(o.chunks_exact(h)))
            {
                for ((s, &x), &o) in s.iter_mut().zip(x).zip(o) {
                    *s = x + o;
                }
                let r = inv_rms(s, eps);
                for ((y, &s), &w) in y.iter_mut().zip(s.iter()).zip(w) {
                    *y = s * r * w;
                }
            }
        });
    Ok((T::to_cpu_storage_owned(sum), T::to_cpu_storage_owned(y)))
}

/// See [`super::add_rms_norm`]. The two results are allocations of their own (not views of one
/// buffer), so each is freed when it is last used, as the separate ops' are.
pub fn add_rms_norm(x: &Tensor, o: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    if x.dims() != o.dims() {
        bail!("{OP}: `x` is {:?} but `o` is {:?}", x.dims(), o.dims())
    }
    same_dtype(OP, ("x", x), ("o", o))?;
    same_device(OP, ("x", x), ("o", o))?;
    let cdt = kernel_dtype(OP, "x", x)?;
    if cdt != x.dtype() {
        // Computed through f32 (bf16 on the CPU): the two ops, for their roundings.
        let sum = super::add::add(x, o)?;
        let y = rms_norm(&sum, weight, eps)?;
        return Ok((sum, y));
    }
    check(x, weight, eps)?;
    let (x, o, w) = (prepare(x, cdt)?, prepare(o, cdt)?, prepare(weight, cdt)?);
    let (xs, xl) = x.storage_and_layout();
    let (os, ol) = o.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (sum, y) = match (&*xs, &*os, &*ws) {
        (Storage::Cpu(xs), Storage::Cpu(os), Storage::Cpu(ws)) => {
            let (x, o, w) = ((xs, xl), (os, ol), (ws, wl));
            let (sum, y) = match xs {
                CpuStorage::F32(_) => add_norm_cpu::<f32>(x, o, w, eps)?,
                CpuStorage::F64(_) => add_norm_cpu::<f64>(x, o, w, eps)?,
                s => bail!("{OP}: unsupported dtype {:?}", s.dtype()),
            };
            (Storage::Cpu(sum), Storage::Cpu(y))
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(xs), Storage::Cuda(os), Storage::Cuda(ws)) => {
            let (x, o, w) = ((xs, xl), (os, ol), (ws, wl));
            let (sum, y) = super::cuda::norm::add_rms_norm_fwd(x, o, w, eps)?;
            (Storage::Cuda(sum), Storage::Cuda(y))
        }
        _ => bail!("{OP}: `x`, `o` and `weight` are not on one supported device"),
    };
    let shape = x.shape().clone();
    let tensor = |s: Storage| Tensor::from_storage(s, shape.clone(), BackpropOp::none(), false);
    Ok((tensor(sum), tensor(y)))
}

/// See [`super::rms_norm_bwd_add`].
pub fn rms_norm_bwd_add(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    dy: &Tensor,
    residual: &Tensor,
) -> Result<(Tensor, Tensor)> {
    if residual.dims() != x.dims() {
        bail!(
            "{OP}: the residual gradient is {:?} but `x` is {:?}",
            residual.dims(),
            x.dims()
        )
    }
    let (dtype, cdt) = (x.dtype(), kernel_dtype(OP, "x", x)?);
    if cdt != dtype || residual.dtype() != dtype {
        // Computed through f32 (bf16 on the CPU): the two ops, for their roundings.
        let (dx, dw) = rms_norm_bwd(x, weight, eps, dy)?;
        return Ok((super::add::add(residual, &dx)?, dw));
    }
    let (xc, wc) = (prepare(x, cdt)?, prepare(weight, cdt)?);
    let bwd = RmsNormBwd {
        eps,
        residual: Some(prepare(residual, cdt)?),
    };
    let flat = xc.apply_op3_no_bwd(&wc, &prepare(dy, cdt)?, &bwd)?;
    let nx = x.elem_count();
    let dx = flat.narrow(0, 0, nx)?.reshape(x.shape())?;
    Ok((dx, flat.narrow(0, nx, weight.elem_count())?))
}
