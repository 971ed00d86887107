//! `swiglu`: the fused `silu(gate) * up` activation of the MLP, with its backward kernel
//! (one pass producing both `d gate` and `d up`); and `swiglu_joined`, the same on the fused
//! gate/up GEMM's output `[.., 2f]` (each row's gate, then its up), whose backward writes the
//! gradient in that layout, ready for the fused input-gradient GEMM.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor,
};
use rayon::prelude::*;

use super::common::{
    kernel_dtype, prepare, rows_per_task, same_device, same_dtype, simd, slice, zip_map, Float,
};

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
                            (dg[i], du[i]) = swiglu_grads(g[i], u[i], gr[i]);
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

/// `d gate` and `d up` of one element: `grad · up · s · (1 + gate · (1 − s))` and
/// `grad · gate · s`, `s = sigmoid(gate)` (the formulas of [`SwiGluBwd`]).
#[inline(always)]
fn swiglu_grads<T: Float>(g: T, u: T, gr: T) -> (T, T) {
    let s = sigmoid(g);
    (gr * u * s * (T::one() + g * (T::one() - s)), gr * g * s)
}

/// Forward on the joined `[.., 2f]`: `[.., f]`.
struct SwiGluJoined {
    f: usize,
}

impl SwiGluJoined {
    fn fwd<T: Float>(&self, s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
        let (gu, f) = (slice::<T>(OP, "gate|up", s, l)?, self.f);
        let mut y = vec![T::zero(); gu.len() / 2];
        let rows = rows_per_task(2 * f);
        y.par_chunks_mut(rows * f)
            .zip(gu.par_chunks(rows * 2 * f))
            .for_each(|(y, gu)| {
                simd(
                    #[inline(always)]
                    || {
                        for (y, gu) in y.chunks_exact_mut(f).zip(gu.chunks_exact(2 * f)) {
                            let (gate, up) = gu.split_at(f);
                            for j in 0..f {
                                y[j] = gate[j] * sigmoid(gate[j]) * up[j];
                            }
                        }
                    },
                )
            });
        Ok(T::to_cpu_storage_owned(y))
    }
}

/// The last dimension of `l`'s shape halved (`[.., 2f]` → `[.., f]`).
fn halved(l: &Layout) -> Shape {
    let mut dims = l.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last /= 2;
    }
    Shape::from(dims)
}

impl CustomOp1 for SwiGluJoined {
    fn name(&self) -> &'static str {
        "swiglu-joined"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = match s {
            CpuStorage::F32(_) => self.fwd::<f32>(s, l)?,
            CpuStorage::F64(_) => self.fwd::<f64>(s, l)?,
            s => bail!("{OP}: unsupported dtype {:?}", s.dtype()),
        };
        Ok((y, halved(l)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = super::cuda::pointwise::swiglu_joined_fwd(s, l, self.f)?;
        Ok((y, halved(l)))
    }
}

/// Backward on the joined `(gate|up [.., 2f], grad [.., f])`: `[.., 2f]`, each row's `d gate`
/// then its `d up`.
struct SwiGluJoinedBwd {
    f: usize,
}

impl SwiGluJoinedBwd {
    fn bwd<T: Float>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<CpuStorage> {
        let (gu, f) = (slice::<T>(OP, "gate|up", s1, l1)?, self.f);
        let grad = slice::<T>(OP, "grad", s2, l2)?;
        let mut out = vec![T::zero(); gu.len()];
        let rows = rows_per_task(2 * f);
        out.par_chunks_mut(rows * 2 * f)
            .zip(gu.par_chunks(rows * 2 * f).zip(grad.par_chunks(rows * f)))
            .for_each(|(out, (gu, grad))| {
                simd(
                    #[inline(always)]
                    || {
                        let rows = out.chunks_exact_mut(2 * f).zip(gu.chunks_exact(2 * f));
                        for ((out, gu), gr) in rows.zip(grad.chunks_exact(f)) {
                            let (gate, up) = gu.split_at(f);
                            let (dg, du) = out.split_at_mut(f);
                            for j in 0..f {
                                (dg[j], du[j]) = swiglu_grads(gate[j], up[j], gr[j]);
                            }
                        }
                    },
                )
            });
        Ok(T::to_cpu_storage_owned(out))
    }
}

impl CustomOp2 for SwiGluJoinedBwd {
    fn name(&self) -> &'static str {
        "swiglu-joined-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match s1 {
            CpuStorage::F32(_) => self.bwd::<f32>(s1, l1, s2, l2)?,
            CpuStorage::F64(_) => self.bwd::<f64>(s1, l1, s2, l2)?,
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
        let out = super::cuda::pointwise::swiglu_joined_bwd(s1, l1, s2, l2, self.f)?;
        Ok((out, l1.shape().clone()))
    }
}

/// The `f` of a joined `[.., 2f]` (an error unless its last dimension is even).
fn joined_width(gu: &Tensor) -> Result<usize> {
    match gu.dims().last() {
        Some(&two_f) if two_f % 2 == 0 => Ok(two_f / 2),
        _ => bail!("{OP}: gate|up must be [.., 2f], got {:?}", gu.dims()),
    }
}

/// See [`super::swiglu_joined`].
pub fn swiglu_joined(gu: &Tensor) -> Result<Tensor> {
    let (dtype, cdt) = (gu.dtype(), kernel_dtype(OP, "gate|up", gu)?);
    let f = joined_width(gu)?;
    prepare(gu, cdt)?
        .apply_op1_no_bwd(&SwiGluJoined { f })?
        .to_dtype(dtype)
}

/// See [`super::swiglu_joined_bwd`].
pub fn swiglu_joined_bwd(gu: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let (dtype, cdt) = (gu.dtype(), kernel_dtype(OP, "gate|up", gu)?);
    let f = joined_width(gu)?;
    if dy.elem_count() * 2 != gu.elem_count() {
        bail!(
            "{OP}: grad {:?} is not half of gate|up {:?}",
            dy.dims(),
            gu.dims()
        )
    }
    prepare(gu, cdt)?
        .apply_op2_no_bwd(&prepare(dy, cdt)?, &SwiGluJoinedBwd { f })?
        .to_dtype(dtype)
}
