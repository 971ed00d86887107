//! `swiglu`: the fused `silu(gate) * up` activation of the MLP, with its backward kernel
//! (one pass producing both `d gate` and `d up`).

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::common::{kernel_dtype, prepare, same_device, same_dtype, simd, slice, zip_map, Float};

const OP: &str = "swiglu";

/// Elements per rayon task.
const CHUNK: usize = 16 * 1024;

#[inline]
fn sigmoid<T: Float>(x: T) -> T {
    T::one() / (T::one() + (-x).fast_exp())
}

/// Forward: `y = gate * sigmoid(gate) * up`.
struct SwiGlu;

impl SwiGlu {
    fn fwd<T: Float>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<CpuStorage> {
        let gate = slice::<T>(OP, "gate", s1, l1)?;
        let up = slice::<T>(OP, "up", s2, l2)?;
        let out = zip_map(gate, up, CHUNK, |g, u| g * sigmoid(g) * u);
        Ok(T::to_cpu_storage_owned(out))
    }
}

impl CustomOp2 for SwiGlu {
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
        let out = super::cuda::pointwise::swiglu_fwd(s1, l1, s2, l2)?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        // [2, ..shape]: index 0 is d gate, index 1 is d up.
        let both = gate.apply_op3_no_bwd(up, &grad, &SwiGluBwd)?;
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

/// Backward kernel on `(gate, up, grad)`; returns `[2, ..shape]` = `[d gate, d up]` with
/// `d gate = grad * up * s * (1 + gate * (1 - s))`, `d up = grad * gate * s`, `s = sigmoid(gate)`.
struct SwiGluBwd;

impl SwiGluBwd {
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
        let gate = slice::<T>(OP, "gate", s1, l1)?;
        let up = slice::<T>(OP, "up", s2, l2)?;
        let grad = slice::<T>(OP, "grad", s3, l3)?;
        let n = gate.len();
        let mut out = vec![T::zero(); 2 * n];
        let (dgate, dup) = out.split_at_mut(n);
        dgate
            .par_chunks_mut(CHUNK)
            .zip(dup.par_chunks_mut(CHUNK))
            .zip(
                gate.par_chunks(CHUNK)
                    .zip(up.par_chunks(CHUNK))
                    .zip(grad.par_chunks(CHUNK)),
            )
            .for_each(|((dg, du), ((g, u), gr))| {
                simd(
                    #[inline(always)]
                    || {
                        for i in 0..dg.len() {
                            let (g, u, gr) = (g[i], u[i], gr[i]);
                            let s = sigmoid(g);
                            dg[i] = gr * u * s * (T::one() + g * (T::one() - s));
                            du[i] = gr * g * s;
                        }
                    },
                )
            });
        Ok(T::to_cpu_storage_owned(out))
    }
}

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "swiglu-bwd"
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
        let mut dims = vec![2];
        dims.extend_from_slice(l1.dims());
        Ok((out, Shape::from(dims)))
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
        let out = super::cuda::pointwise::swiglu_bwd(s1, l1, s2, l2, s3, l3)?;
        let mut dims = vec![2];
        dims.extend_from_slice(l1.dims());
        Ok((out, Shape::from(dims)))
    }
}

/// See [`super::swiglu`].
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        bail!(
            "{OP}: shape mismatch, `gate` is {:?} but `up` is {:?}",
            gate.dims(),
            up.dims()
        )
    }
    same_dtype(OP, ("gate", gate), ("up", up))?;
    same_device(OP, ("gate", gate), ("up", up))?;
    let dtype = gate.dtype();
    let cdt = kernel_dtype(OP, "gate", gate)?;
    let y = prepare(gate, cdt)?.apply_op2(&prepare(up, cdt)?, SwiGlu)?;
    y.to_dtype(dtype)
}

/// See [`super::swiglu_bwd`].
pub fn swiglu_bwd(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let (dtype, cdt) = (gate.dtype(), kernel_dtype(OP, "gate", gate)?);
    let (gc, uc) = (prepare(gate, cdt)?, prepare(up, cdt)?);
    match SwiGlu.bwd(&gc, &uc, &gc, &dy.to_dtype(cdt)?)? {
        (Some(dg), Some(du)) => Ok((dg.to_dtype(dtype)?, du.to_dtype(dtype)?)),
        _ => bail!("{OP}: the backward kernel gave no gradient"),
    }
}
