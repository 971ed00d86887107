//! `causal_attention`: flash-style causal scaled-dot-product attention with grouped-query heads
//! on the `[b, s, heads, d]` layout: the forward op, its public wrapper and the per-head GEMM
//! helper shared with the backward kernel (in `attention_bwd.rs`).
//!
//! The forward runs one rayon task per `(batch, query head)`. Each task walks blocks of `BLOCK`
//! query rows; a block's scores against the keys it may see (`[BLOCK, r1]`) live in a transient
//! per-task scratch, get a row softmax and are multiplied by `V`; with a document floor
//! (`attention_dims.rs`) a block's keys start at its rows' lowest floor and each row's keys at its
//! own. Only the per-row log-sum-exp
//! `[b, hq, s]` survives the op (stashed in the op struct for the backward pass, as a tensor on
//! the device of the inputs). With the `cuda` feature, CUDA inputs run the flash kernels of
//! `cuda/attention.rs` on f32, f64 or bf16 storage, or cuDNN's fused attention (`cuda/cudnn.rs`)
//! where the [`AttentionBackend`] routes a call there; the log-sum-exp is f32 (f64 for f64).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

#[cfg(feature = "cuda")]
use candle_core::{op::BackpropOp, CudaStorage, Storage};

use super::attention_bwd::AttentionBwd;
pub(crate) use super::attention_dims::{check_floor, Dims, Floor};
use super::common::{
    kernel_dtype, max, prepare, same_device, same_dtype, simd, slice, sum, Float, SyncPtr,
};
use super::sdpa::AttentionBackend;

pub(super) const OP: &str = "causal_attention";

/// Query rows per block: bounds the per-task scratch to `BLOCK * s` elements.
pub(super) const BLOCK: usize = 64;

/// `dst[m×n] = (acc ? dst : 0) + beta · lhs[m×k] · rhs[k×n]`, single-threaded (called inside rayon
/// tasks). Every matrix is `(pointer, row stride, column stride)` in elements; `dst` has unit
/// column stride.
///
/// # Safety
/// All pointers must be valid for the elements the strides and sizes address, and `dst` must not
/// be written concurrently by another task.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(super) unsafe fn matmul<T: Float>(
    (m, n, k): (usize, usize, usize),
    dst: (*mut T, usize),
    acc: bool,
    lhs: (*const T, usize, usize),
    rhs: (*const T, usize, usize),
    beta: T,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst.0,
        1,
        dst.1 as isize,
        acc,
        lhs.0,
        lhs.2 as isize,
        lhs.1 as isize,
        rhs.0,
        rhs.2 as isize,
        rhs.1 as isize,
        T::one(),
        beta,
        false,
        false,
        false,
        gemm::Parallelism::None,
    )
}

/// Forward kernel: returns the output `[b, s, hq, d]` and the log-sum-exp `[b, hq, s]`. A row
/// that sees no key (a block of ring attention wholly before its document) gets a zero output and
/// a log-sum-exp of −∞.
fn attention_fwd<T: Float>(
    (q, k, v): (&[T], &[T], &[T]),
    dm: Dims,
    floor: Floor<'_>,
    scale: T,
) -> (Vec<T>, Vec<T>) {
    let Dims {
        b,
        s,
        sk,
        hq,
        hkv,
        d,
        ..
    } = dm;
    let (qs, ks) = (hq * d, hkv * d); // row strides of q/out and k/v
    let group = dm.group();
    let mut out = vec![T::zero(); b * s * qs]; // [b, s, hq, d]
    let mut lse = vec![T::zero(); b * hq * s]; // [b, hq, s]
    if out.is_empty() || sk == 0 {
        return (out, lse);
    }
    let out_ptr = SyncPtr(out.as_mut_ptr());
    lse.par_chunks_mut(s).enumerate().for_each(|(bh, lse)| {
        let (bi, h) = (bh / hq, bh % hq);
        let g = h / group;
        // SAFETY: offsets stay inside `[b, s, h*, d]`; this task alone writes head `h` of batch
        // `bi` of `out`.
        unsafe {
            let q_h = q.as_ptr().add(bi * s * qs + h * d); // [s, d], row stride qs
            let k_h = k.as_ptr().add(bi * sk * ks + g * d); // [sk, d], row stride ks
            let v_h = v.as_ptr().add(bi * sk * ks + g * d); // [sk, d], row stride ks
            let o_h = out_ptr.get().add(bi * s * qs + h * d); // [s, d], row stride qs
            let mut scores = vec![T::zero(); BLOCK.min(s) * sk]; // [m, n] scratch
            for r0 in (0..s).step_by(BLOCK) {
                let r1 = (r0 + BLOCK).min(s);
                let (lo, hi) = dm.block_keys(floor, bi, r0, r1); // rows r0..r1 see keys lo..hi
                let (m, n) = (r1 - r0, hi - lo);
                if n == 0 {
                    lse[r0..r1].fill(T::neg_infinity()); // and the output rows stay zero
                    continue;
                }

                // S = Q[r0..r1] · K[lo..hi]^T · scale   [m, n]
                let sp = scores.as_mut_ptr();
                matmul(
                    (m, n, d),
                    (sp, n),
                    false,
                    (q_h.add(r0 * qs), qs, 1),
                    (k_h.add(lo * ks), 1, ks),
                    scale,
                );
                for (i, row) in scores[..m * n].chunks_exact_mut(n).enumerate() {
                    let qi = r0 + i;
                    let (a, z) = dm.row_range(floor, bi, qi);
                    let (a, z) = (a - lo, z - lo);
                    if a == z {
                        row.fill(T::zero());
                        lse[qi] = T::neg_infinity();
                        continue;
                    }
                    let (before, rest) = row.split_at_mut(a);
                    let (seen, masked) = rest.split_at_mut(z - a);
                    before.fill(T::zero());
                    let (row_max, row_sum) = simd(
                        #[inline(always)]
                        || {
                            let row_max = max(seen);
                            seen.iter_mut().for_each(|x| *x = (*x - row_max).fast_exp());
                            let row_sum = sum(seen);
                            let inv = T::one() / row_sum;
                            seen.iter_mut().for_each(|x| *x *= inv);
                            (row_max, row_sum)
                        },
                    );
                    masked.fill(T::zero());
                    lse[qi] = row_max + row_sum.ln();
                }
                // O[r0..r1] = P · V[lo..hi]   [m, d]
                let o_blk = (o_h.add(r0 * qs), qs);
                let v_blk = (v_h.add(lo * ks), ks, 1);
                matmul((m, d, n), o_blk, false, (sp, n, 1), v_blk, T::one());
            }
        }
    });
    (out, lse)
}

/// The forward op on `(q, k, v)`; keeps the log-sum-exp `[b, hq, s]` for the backward pass (in
/// the dtype of the inputs on the CPU; f32, or f64 for f64, on CUDA).
struct Attention<'a> {
    scale: f64,
    causal: bool,
    floor: Floor<'a>,
    backend: AttentionBackend,
    lse: Mutex<Option<Tensor>>,
}

impl Attention<'_> {
    #[allow(clippy::too_many_arguments)]
    fn fwd<T: Float>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<CpuStorage> {
        let dm = Dims::from_layouts(l1, l2, self.causal)?;
        let q = slice::<T>(OP, "q", s1, l1)?;
        let k = slice::<T>(OP, "k", s2, l2)?;
        let v = slice::<T>(OP, "v", s3, l3)?;
        let (out, lse) = attention_fwd((q, k, v), dm, self.floor, T::from_f64(self.scale));
        self.stash(Tensor::from_vec(lse, (dm.b, dm.hq, dm.s), &Device::Cpu)?);
        Ok(T::to_cpu_storage_owned(out))
    }

    /// Stashes the log-sum-exp for the backward pass.
    fn stash(&self, lse: Tensor) {
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
    }
}

impl CustomOp3 for Attention<'_> {
    fn name(&self) -> &'static str {
        OP
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
            CpuStorage::F32(_) => self.fwd::<f32>(s1, l1, s2, l2, s3, l3)?,
            CpuStorage::F64(_) => self.fwd::<f64>(s1, l1, s2, l2, s3, l3)?,
            s => bail!("{OP}: unsupported dtype {:?}", s.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dm = Dims::from_layouts(l1, l2, self.causal)?;
        let (q, k, v) = ((s1, l1), (s2, l2), (s3, l3));
        // Documents kept apart run on cuDNN as a ragged batch when the floor splits the call
        // into documents; other floors (ring blocks) run the project's kernels.
        let cudnn = if self.backend.runs_cudnn(s1.dtype(), dm.d) {
            super::cuda::cudnn::attention_fwd(q, k, v, (dm, self.floor), self.scale)?
        } else {
            None
        };
        let (out, lse) = match cudnn {
            Some(ran) => ran,
            None => {
                let mask = (dm, self.floor);
                super::cuda::attention::attention_fwd(q, k, v, mask, self.scale)?
            }
        };
        let lse = Storage::Cuda(lse); // [b, hq, s]
        self.stash(Tensor::from_storage(
            lse,
            (dm.b, dm.hq, dm.s),
            BackpropOp::none(),
            false,
        ));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(lse) = lse else {
            bail!("{OP}: backward called without a stashed log-sum-exp (the forward did not run)")
        };
        let bwd = AttentionBwd {
            scale: self.scale,
            causal: self.causal,
            floor: self.floor,
            backend: self.backend,
            out: out.contiguous()?,
            dout: grad.contiguous()?,
            lse,
        };
        // Flat [nq + 2 nkv]: dq [b, s, hq, d], dk and dv [b, s, hkv, d].
        let flat = q.apply_op3_no_bwd(k, v, &bwd)?;
        let (nq, nkv) = (q.elem_count(), k.elem_count());
        let dq = flat.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dk = flat.narrow(0, nq, nkv)?.reshape(k.shape())?;
        let dv = flat.narrow(0, nq + nkv, nkv)?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Checks the shapes, dtypes and devices of an attention call (`k` may have other rows than `q`
/// unless `causal`) and returns `q`, `k`, `v` contiguous in the kernels' compute dtype.
fn checked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let &[b, s, hq, d] = q.dims() else {
        bail!("{OP}: `q` must be [b, s, hq, d], got {:?}", q.dims())
    };
    let &[kb, ks, hkv, kd] = k.dims() else {
        bail!("{OP}: `k` must be [b, s, hkv, d], got {:?}", k.dims())
    };
    if (kb, kd) != (b, d) || (causal && ks != s) || ks == 0 {
        bail!(
            "{OP}: `k` {:?} does not match `q` {:?} in b, s or d",
            k.dims(),
            q.dims()
        )
    }
    if v.dims() != k.dims() {
        bail!(
            "{OP}: `v` {:?} must have the shape of `k` {:?}",
            v.dims(),
            k.dims()
        )
    }
    if hkv == 0 || hq % hkv != 0 {
        bail!("{OP}: query heads {hq} must be a multiple of kv heads {hkv}")
    }
    if d == 0 {
        bail!("{OP}: the head dim must be non-zero")
    }
    if !scale.is_finite() {
        bail!("{OP}: `scale` must be finite, got {scale}")
    }
    same_dtype(OP, ("q", q), ("k", k))?;
    same_dtype(OP, ("q", q), ("v", v))?;
    same_device(OP, ("q", q), ("k", k))?;
    same_device(OP, ("q", q), ("v", v))?;
    let cdt = kernel_dtype(OP, "q", q)?;
    Ok((prepare(q, cdt)?, prepare(k, cdt)?, prepare(v, cdt)?))
}

/// See [`super::causal_attention`].
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let dtype = q.dtype();
    let (q, k, v) = checked(q, k, v, scale, true)?;
    let op = Attention {
        scale,
        causal: true,
        floor: None,
        backend: AttentionBackend::Own,
        lse: Mutex::new(None),
    };
    q.apply_op3(&k, &v, op)?.to_dtype(dtype)
}

/// The forward kernel of `backend` without a graph: the output in the kernel dtype
/// (`[b, s, hq, d]`) and the log-sum-exp `[b, hq, s]`.
fn forward_kernel(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    scale: f64,
    (causal, floor): (bool, Floor<'_>),
    backend: AttentionBackend,
) -> Result<(Tensor, Tensor)> {
    let (q, k, v) = checked(q, k, v, scale, causal)?;
    check_floor(floor, &q)?;
    let op = Attention {
        scale,
        causal,
        floor,
        backend,
        lse: Mutex::new(None),
    };
    let out = q.apply_op3_no_bwd(&k, &v, &op)?;
    let lse = op.lse.lock().unwrap_or_else(|e| e.into_inner()).take();
    let Some(lse) = lse else {
        bail!("{OP}: the forward kernel left no log-sum-exp")
    };
    Ok((out, lse))
}

/// The backward kernel of `backend` without a graph: `(dq, dk, dv)` in the kernel dtype.
fn backward_kernel(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (out, lse): (&Tensor, &Tensor),
    dout: &Tensor,
    scale: f64,
    (causal, floor): (bool, Floor<'_>),
    backend: AttentionBackend,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (qc, kc, vc) = checked(q, k, v, scale, causal)?;
    check_floor(floor, &qc)?;
    let cdt = qc.dtype();
    let bwd = AttentionBwd {
        scale,
        causal,
        floor,
        backend,
        out: prepare(out, cdt)?,
        dout: prepare(dout, cdt)?,
        lse: lse.contiguous()?,
    };
    let flat = qc.apply_op3_no_bwd(&kc, &vc, &bwd)?; // [nq + 2 nkv]
    let (nq, nkv) = (q.elem_count(), k.elem_count());
    let part = |at: usize, n: usize, t: &Tensor| flat.narrow(0, at, n)?.reshape(t.shape());
    Ok((part(0, nq, q)?, part(nq, nkv, k)?, part(nq + nkv, nkv, v)?))
}

/// See [`super::attention_block`].
pub fn attention_block(
    qkv: (&Tensor, &Tensor, &Tensor),
    scale: f64,
    mask: (bool, Floor<'_>),
    backend: AttentionBackend,
) -> Result<(Tensor, Tensor)> {
    let (out, lse) = forward_kernel(qkv, scale, mask, backend)?;
    Ok((out.to_dtype(lse.dtype())?, lse))
}

/// See [`super::attention_block_bwd`].
pub fn attention_block_bwd(
    qkv: (&Tensor, &Tensor, &Tensor),
    merged: (&Tensor, &Tensor),
    dout: &Tensor,
    scale: f64,
    mask: (bool, Floor<'_>),
    backend: AttentionBackend,
) -> Result<(Tensor, Tensor, Tensor)> {
    let acc = merged.1.dtype();
    let (dq, dk, dv) = backward_kernel(qkv, merged, dout, scale, mask, backend)?;
    Ok((dq.to_dtype(acc)?, dk.to_dtype(acc)?, dv.to_dtype(acc)?))
}

/// See [`super::causal_attention_saved`].
pub fn causal_attention_saved(
    qkv: (&Tensor, &Tensor, &Tensor),
    scale: f64,
    floor: Floor<'_>,
    backend: AttentionBackend,
) -> Result<(Tensor, Tensor)> {
    forward_kernel(qkv, scale, (true, floor), backend)
}

/// See [`super::causal_attention_bwd`].
pub fn causal_attention_bwd(
    qkv: (&Tensor, &Tensor, &Tensor),
    saved: (&Tensor, &Tensor),
    dout: &Tensor,
    scale: f64,
    floor: Floor<'_>,
    backend: AttentionBackend,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (dq, dk, dv) = backward_kernel(qkv, saved, dout, scale, (true, floor), backend)?;
    let dtype = qkv.0.dtype();
    Ok((
        dq.to_dtype(dtype)?,
        dk.to_dtype(dtype)?,
        dv.to_dtype(dtype)?,
    ))
}
