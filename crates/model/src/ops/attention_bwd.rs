//! Backward kernel of `causal_attention`: recomputes the probabilities per `(batch, query head)`
//! from the stashed log-sum-exp (`P = exp(S · scale - lse)`) and computes `dQ`, `dK`, `dV`, with
//! `dK`/`dV` summed over the query heads that share a kv head (GQA). With the `cuda` feature,
//! CUDA inputs run the deterministic flash backward kernels of `cuda/attention.rs`.

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;

use super::attention::{matmul, Dims, Floor, BLOCK, OP};
use super::common::{dot, simd, slice, Float, SyncPtr};
use super::sdpa::AttentionBackend;

/// Forward-only op on `(q, k, v)` computing their gradients; the forward output, its upstream
/// gradient and the log-sum-exp ride along in the struct. Returns the flat `[nq + 2 nkv]`
/// concatenation of `dq [b, s, hq, d]`, `dk [b, sk, hkv, d]` and `dv [b, sk, hkv, d]`. For a
/// block of ring attention, `out` and `lse` are those of the whole (merged) attention, so that
/// `P = exp(S · scale - lse)` are the block's share of the final probabilities.
pub(super) struct AttentionBwd<'a> {
    pub scale: f64,
    /// Causal mask, or none (see [`Dims`]).
    pub causal: bool,
    /// The first key each query row sees (document masking), or none.
    pub floor: Floor<'a>,
    /// Which kernels run the backward on CUDA (see [`AttentionBackend::runs_cudnn`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub backend: AttentionBackend,
    /// Forward output `[b, s, hq, d]`, contiguous.
    pub out: Tensor,
    /// Upstream gradient of the output `[b, s, hq, d]`, contiguous.
    pub dout: Tensor,
    /// Per-row log-sum-exp of the scaled scores `[b, hq, s]` (on CUDA f32, or f64 for f64).
    pub lse: Tensor,
}

/// The gradient tensors of one call, as borrowed slices.
struct Inputs<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    o: &'a [T],
    dout: &'a [T],
    lse: &'a [T],
}

/// Backward kernel; see [`AttentionBwd`] for the output layout.
fn attention_bwd<T: Float>(x: Inputs<'_, T>, dm: Dims, floor: Floor<'_>, scale: T) -> Vec<T> {
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
    let (nq, nkv) = (b * s * qs, b * sk * ks);
    let mut out = vec![T::zero(); nq + 2 * nkv];
    if nq == 0 || nkv == 0 {
        return out;
    }
    // With GQA every query head accumulates its own dK/dV `[b, hq, sk, d]`, reduced afterwards.
    let np = b * hq * sk * d;
    let mut parts = vec![T::zero(); if group > 1 { 2 * np } else { 0 }];
    let (dq, dkv) = out.split_at_mut(nq);
    let (dk, dv) = dkv.split_at_mut(nkv);
    let (dq_p, dk_p, dv_p) = (
        SyncPtr(dq.as_mut_ptr()),
        SyncPtr(dk.as_mut_ptr()),
        SyncPtr(dv.as_mut_ptr()),
    );
    let parts_p = SyncPtr(parts.as_mut_ptr());
    (0..b * hq).into_par_iter().for_each(|bh| {
        let (bi, h) = (bh / hq, bh % hq);
        let g = h / group;
        let (q_off, kv_off) = (bi * s * qs + h * d, bi * sk * ks + g * d);
        let lse = &x.lse[bh * s..(bh + 1) * s]; // [s]

        // D_i = Σ_c dO[i, c] · O[i, c]   [s]
        let dsum: Vec<T> = (0..s)
            .map(|i| {
                let at = q_off + i * qs;
                dot(&x.o[at..at + d], &x.dout[at..at + d])
            })
            .collect();
        let mut p = vec![T::zero(); BLOCK.min(s) * sk]; // [m, n] probabilities
        let mut ds = vec![T::zero(); BLOCK.min(s) * sk]; // [m, n] dP, then dS

        // SAFETY: offsets stay inside the `[b, s, h*, d]` buffers; this task alone writes head `h`
        // of batch `bi` of dq, its own slot of `parts`, or (no GQA) head `g == h` of dk/dv.
        unsafe {
            let q_h = x.q.as_ptr().add(q_off); // [s, d], row stride qs
            let do_h = x.dout.as_ptr().add(q_off); // [s, d], row stride qs
            let k_h = x.k.as_ptr().add(kv_off); // [sk, d], row stride ks
            let v_h = x.v.as_ptr().add(kv_off); // [sk, d], row stride ks
            let dq_h = dq_p.get().add(q_off); // [s, d], row stride qs
            let (dk_h, dv_h, kv_rs) = if group > 1 {
                let at = bh * sk * d; // [b, hq, sk, d]
                (parts_p.get().add(at), parts_p.get().add(np + at), d)
            } else {
                (dk_p.get().add(kv_off), dv_p.get().add(kv_off), ks)
            };
            for r0 in (0..s).step_by(BLOCK) {
                let r1 = (r0 + BLOCK).min(s);
                let (lo, hi) = dm.block_keys(floor, bi, r0, r1); // rows r0..r1 see keys lo..hi
                let (m, n) = (r1 - r0, hi - lo);
                if n == 0 {
                    continue; // dQ rows stay zero, no key gets a gradient
                }
                let (k_b, v_b) = (k_h.add(lo * ks), v_h.add(lo * ks)); // K, V [lo..hi]
                let (dk_b, dv_b) = (dk_h.add(lo * kv_rs), dv_h.add(lo * kv_rs));
                let (pp, dsp) = (p.as_mut_ptr(), ds.as_mut_ptr());
                let (q_blk, do_blk) = ((q_h.add(r0 * qs), qs, 1), (do_h.add(r0 * qs), qs, 1));
                // P = exp(Q[r0..r1] · K[lo..hi]^T · scale - lse), masked   [m, n]
                matmul((m, n, d), (pp, n), false, q_blk, (k_b, 1, ks), scale);
                for (i, row) in p[..m * n].chunks_exact_mut(n).enumerate() {
                    let qi = r0 + i;
                    let (a, z) = dm.row_range(floor, bi, qi);
                    let (a, z) = (a - lo, z - lo);
                    let (before, rest) = row.split_at_mut(a);
                    let (seen, masked) = rest.split_at_mut(z - a);
                    let shift = lse[qi];
                    simd(
                        #[inline(always)]
                        || seen.iter_mut().for_each(|x| *x = (*x - shift).fast_exp()),
                    );
                    before.fill(T::zero());
                    masked.fill(T::zero());
                }
                // dV[lo..hi] += P^T · dO[r0..r1]   [n, d]
                matmul((n, d, m), (dv_b, kv_rs), true, (pp, 1, n), do_blk, T::one());
                // dP = dO[r0..r1] · V[lo..hi]^T   [m, n]
                matmul((m, n, d), (dsp, n), false, do_blk, (v_b, 1, ks), T::one());
                // dS = P ∘ (dP - D) · scale   [m, n] (zero where masked, as P is)
                for (i, (dsr, pr)) in ds[..m * n]
                    .chunks_exact_mut(n)
                    .zip(p[..m * n].chunks_exact(n))
                    .enumerate()
                {
                    let di = dsum[r0 + i];
                    for (dsv, &pv) in dsr.iter_mut().zip(pr) {
                        *dsv = pv * (*dsv - di) * scale;
                    }
                }
                // dQ[r0..r1] = dS · K[lo..hi]   [m, d]
                matmul(
                    (m, d, n),
                    (dq_h.add(r0 * qs), qs),
                    false,
                    (dsp, n, 1),
                    (k_b, ks, 1),
                    T::one(),
                );
                // dK[lo..hi] += dS^T · Q[r0..r1]   [n, d]
                matmul((n, d, m), (dk_b, kv_rs), true, (dsp, 1, n), q_blk, T::one());
            }
        }
    });
    if group > 1 {
        let (pk, pv) = parts.split_at(np);
        // dK[bi, j, g] = Σ_t dK_part[bi, g * group + t, j]   (same for dV), one task per (bi, j)
        dk.par_chunks_mut(ks)
            .zip(dv.par_chunks_mut(ks))
            .enumerate()
            .for_each(|(row, (dk, dv))| {
                let (bi, j) = (row / sk, row % sk);
                for (g, (dk, dv)) in dk
                    .chunks_exact_mut(d)
                    .zip(dv.chunks_exact_mut(d))
                    .enumerate()
                {
                    for t in 0..group {
                        let at = ((bi * hq + g * group + t) * sk + j) * d;
                        for c in 0..d {
                            dk[c] += pk[at + c];
                            dv[c] += pv[at + c];
                        }
                    }
                }
            });
    }
    out
}

/// The CPU storage of a tensor held by the op.
fn cpu<'a>(name: &str, storage: &'a Storage) -> Result<&'a CpuStorage> {
    super::common::held_cpu(OP, name, storage)
}

/// The CUDA storage of a tensor held by the op.
#[cfg(feature = "cuda")]
fn cuda<'a>(name: &str, storage: &'a Storage) -> Result<&'a CudaStorage> {
    super::common::held_cuda(OP, name, storage)
}

impl AttentionBwd<'_> {
    /// The sizes of the call from the layouts of `q` and `k`, after checking that `out`, `dout`
    /// and `lse` match them.
    fn dims(&self, l1: &Layout, l2: &Layout) -> Result<Dims> {
        let (&[b, s, hq, d], &[_, _, hkv, _]) = (l1.dims(), l2.dims()) else {
            bail!(
                "{OP}: backward expects rank-4 q and k, got {:?} and {:?}",
                l1.dims(),
                l2.dims()
            )
        };
        let (sk, causal) = (l2.dims()[1], self.causal);
        if causal && sk != s {
            bail!("{OP}: backward of a causal call needs as many keys ({sk}) as queries ({s})")
        }
        let dm = Dims {
            b,
            s,
            sk,
            hq,
            hkv,
            d,
            causal,
        };
        for (name, t) in [("out", &self.out), ("dout", &self.dout)] {
            if t.dims() != l1.dims() {
                bail!(
                    "{OP}: backward `{name}` {:?} does not match q {:?}",
                    t.dims(),
                    l1.dims()
                )
            }
        }
        if self.lse.dims() != [b, hq, s] {
            bail!(
                "{OP}: backward lse {:?} is not [b, hq, s] = [{b}, {hq}, {s}]",
                self.lse.dims()
            )
        }
        Ok(dm)
    }

    #[allow(clippy::too_many_arguments)]
    fn run<T: Float>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<CpuStorage> {
        let dm = self.dims(l1, l2)?;
        let (o_st, o_l) = self.out.storage_and_layout();
        let (do_st, do_l) = self.dout.storage_and_layout();
        let (lse_st, lse_l) = self.lse.storage_and_layout();
        let x = Inputs {
            q: slice::<T>(OP, "q", s1, l1)?,
            k: slice::<T>(OP, "k", s2, l2)?,
            v: slice::<T>(OP, "v", s3, l3)?,
            o: slice::<T>(OP, "out", cpu("out", &o_st)?, o_l)?,
            dout: slice::<T>(OP, "dout", cpu("dout", &do_st)?, do_l)?,
            lse: slice::<T>(OP, "lse", cpu("lse", &lse_st)?, lse_l)?,
        };
        Ok(T::to_cpu_storage_owned(attention_bwd(
            x,
            dm,
            self.floor,
            T::from_f64(self.scale),
        )))
    }
}

impl CustomOp3 for AttentionBwd<'_> {
    fn name(&self) -> &'static str {
        "causal_attention-bwd"
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
            CpuStorage::F32(_) => self.run::<f32>(s1, l1, s2, l2, s3, l3)?,
            CpuStorage::F64(_) => self.run::<f64>(s1, l1, s2, l2, s3, l3)?,
            s => bail!("{OP}: unsupported dtype {:?}", s.dtype()),
        };
        let len = l1.shape().elem_count() + 2 * l2.shape().elem_count();
        Ok((out, Shape::from(len)))
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
        let dm = self.dims(l1, l2)?;
        let (o_st, o_l) = self.out.storage_and_layout(); // [b, s, hq, d]
        let (do_st, do_l) = self.dout.storage_and_layout(); // [b, s, hq, d]
        let (lse_st, lse_l) = self.lse.storage_and_layout(); // [b, hq, s]
        let (qkv, out) = ([(s1, l1), (s2, l2), (s3, l3)], (cuda("out", &o_st)?, o_l));
        let (dout, lse) = (
            (cuda("dout", &do_st)?, do_l),
            (cuda("lse", &lse_st)?, lse_l),
        );
        // As in the forward: documents as a ragged batch, other floors on the project's kernels.
        let cudnn = if self.backend.runs_cudnn(s1.dtype(), dm.d) {
            let mask = (dm, self.floor);
            let deterministic = self.backend.deterministic();
            super::cuda::cudnn::attention_bwd(qkv, out, dout, lse, mask, self.scale, deterministic)?
        } else {
            None
        };
        let flat = match cudnn {
            Some(ran) => ran,
            None => {
                let mask = (dm, self.floor);
                super::cuda::attention::attention_bwd(qkv, out, dout, lse, mask, self.scale)?
            }
        };
        let len = l1.shape().elem_count() + 2 * l2.shape().elem_count();
        Ok((flat, Shape::from(len)))
    }
}
