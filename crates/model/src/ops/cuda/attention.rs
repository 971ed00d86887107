//! Launchers of the attention kernels (`kernels/attention.cu`: causal, or unmasked blocks of
//! context-parallel ring attention with `sk` keys) on contiguous f32, f64 or bf16 CUDA storage;
//! called from the `cuda_fwd` of `Attention` and `AttentionBwd`.
//!
//! Forward: one kernel writes the output `[b, s, hq, d]` and the per-row log-sum-exp `[b, hq, s]`
//! in the accumulation type (f32, f64 for f64). Backward: `attn_bwd_delta` (`Σ dO · O` per row),
//! then `attn_bwd_dq` and `attn_bwd_dkv`, which write disjoint parts of the flat
//! `[nq + 2 nkv]` result (dQ, dK, dV), each element once: no atomics, deterministic.
//!
//! The kernels are exported per head-dim bucket (`d <= 64`, `<= 128`, `<= 256`); their tile
//! geometry (`Cfg` in the `.cu` file) is mirrored by [`Geometry`] here, which sizes the grid and
//! the dynamic shared memory (at most 32 KiB, under the 48 KiB default limit). The kernels trap if
//! launched with fewer bytes or other than [`THREADS`] threads.
//!
//! For bf16 with head dim 64 or 128 the forward, dQ and dK/dV kernels are the tensor-core
//! variants of `kernels/attention_tc.cu` instead (same parameters and outputs, causal or
//! unmasked; geometry in [`super::attention_tc`]); [`plan`] is the one place that picks a kernel
//! and its launch shape. A call with a document floor (documents kept apart) runs the scalar
//! kernels, which take it (copied to the device per call; the tensor-core ones trap on it).

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, LaunchConfig, PushKernelArg,
};
use candle_core::cuda::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{bail, DType, Layout, Result};

use super::attention_tc::{self, Step, TcGeometry};
use super::{acc_dtype, alloc, grid, kernel_name, load, to_i32, view, KernelFloat, Module};
use crate::ops::attention::{Dims, Floor, OP};

/// Threads per block of every attention kernel (`Cfg::THREADS`).
const THREADS: u32 = 128;

/// Tile geometry of the kernels for head dim `d` and accumulation type size `acc` bytes; must
/// match `Cfg<A, DMAX>` in `kernels/attention.cu`.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    /// Head-dim bucket of the kernel: 64, 128 or 256.
    dmax: usize,
    /// Query rows per block of the forward and dQ kernels (`GROUPS * RI`).
    rows: usize,
    /// Key rows per block of the dK/dV kernel (`GROUPS * RJ`).
    keys: usize,
    /// Rows per shared-memory tile (`TILE`).
    tile: usize,
    /// Row pitch of a tile in elements: `d` rounded up to a chunk (`L * VW`).
    ld: usize,
    /// Bytes per accumulation element.
    acc: usize,
}

impl Geometry {
    fn new(d: usize, acc: usize) -> Result<Self> {
        let dmax = match d {
            1..=64 => 64,
            65..=128 => 128,
            129..=256 => 256,
            _ => bail!("{OP}: head dim {d} is not supported by the CUDA kernels (1 to 256)"),
        };
        let lanes = (dmax * acc / 64).max(8); // L
        let per_lane = dmax / lanes; // DJ
        let groups = THREADS as usize / lanes; // GROUPS
        let ri = 128 / (per_lane * acc); // RI
        let rj = (ri / 2).max(1); // RJ
        let chunk = lanes * (16 / acc); // CHUNK = L * VW
        Ok(Self {
            dmax,
            rows: groups * ri,
            keys: groups * rj,
            tile: 16384 / (dmax * acc),
            ld: d.div_ceil(chunk) * chunk,
            acc,
        })
    }

    /// Dynamic shared memory of the forward and dQ kernels: K and V tiles.
    fn kv_smem(&self) -> u32 {
        (2 * self.tile * self.ld * self.acc) as u32
    }

    /// Dynamic shared memory of the dK/dV kernel: Q and dO tiles, lse and delta.
    fn qdo_smem(&self) -> u32 {
        ((2 * self.tile * self.ld + 2 * self.tile) * self.acc) as u32
    }
}

/// The kernels' integer arguments `b, s, hq, hkv, d, sk, causal`, in that order.
struct Ints([i32; 7]);

impl Ints {
    fn new(dm: Dims) -> Result<Self> {
        if dm.hkv == 0 || !dm.hq.is_multiple_of(dm.hkv) {
            bail!(
                "{OP}: query heads {} must be a multiple of kv heads {}",
                dm.hq,
                dm.hkv
            )
        }
        let mut out = [0i32; 7];
        for (o, (what, x)) in out.iter_mut().zip([
            ("b", dm.b),
            ("s", dm.s),
            ("hq", dm.hq),
            ("hkv", dm.hkv),
            ("d", dm.d),
            ("sk", dm.sk),
            ("causal", usize::from(dm.causal)),
        ]) {
            *o = to_i32(OP, what, x)?;
        }
        Ok(Self(out))
    }
}

/// Kernel `<base>_<dtype>` of the attention module, loaded once per device. (The launchers push
/// arguments onto the stream's builder directly: `super::launch`'s closure gets a builder of a
/// higher-ranked lifetime, which cannot hold borrows of the caller's buffers.)
fn kernel(dev: &CudaDevice, base: &str, dtype: DType) -> Result<CudaFunction> {
    let name = kernel_name(OP, base, dtype)?;
    load(dev, Module::Attention, &name)
}

/// The kernel of `step` for dims `dm` and storage `dtype`, with its launch shape and whether it is
/// a tensor-core kernel: those for bf16 calls with d = 64 or 128, else
/// `<base>_d<DMAX>_<dtype>` shaped by [`Geometry`]. The dK/dV kernel's blocks cover the `sk`
/// keys (per query head for the tensor-core one, per kv head otherwise), the others the `s`
/// queries. Both have the same parameter list per step, except the tensor-core dK/dV kernel's
/// GQA shares (see [`bwd`]). Errors on an unsupported head dim.
fn plan(
    dev: &CudaDevice,
    step: Step,
    dm: Dims,
    dtype: DType,
    floor: bool,
) -> Result<(CudaFunction, LaunchConfig, bool)> {
    if let Some(tc) = TcGeometry::new(dtype, dm.d).filter(|_| !floor) {
        let (units, rows) = match step {
            Step::Fwd | Step::Dq => (dm.b * dm.hq, dm.s),
            Step::Dkv => (dm.b * dm.hq, dm.sk),
        };
        let (f, cfg) = tc.kernel(dev, step, blocks(units, rows, attention_tc::ROWS)?)?;
        return Ok((f, cfg, true));
    }
    let (units, rows) = match step {
        Step::Fwd | Step::Dq => (dm.b * dm.hq, dm.s),
        Step::Dkv => (dm.b * dm.hkv, dm.sk),
    };
    let geo = Geometry::new(dm.d, acc_dtype(dtype).size_in_bytes())?;
    let (base, per_block, smem) = match step {
        Step::Fwd => ("attn_fwd", geo.rows, geo.kv_smem()),
        Step::Dq => ("attn_bwd_dq", geo.rows, geo.kv_smem()),
        Step::Dkv => ("attn_bwd_dkv", geo.keys, geo.qdo_smem()),
    };
    let f = kernel(dev, &format!("{base}_d{}", geo.dmax), dtype)?;
    Ok((
        f,
        grid(blocks(units, rows, per_block)?, THREADS, smem),
        false,
    ))
}

/// `units · ceil(s / per_block)` blocks, checked against the kernels' `int` block indices.
fn blocks(units: usize, s: usize, per_block: usize) -> Result<usize> {
    let n = units.saturating_mul(s.div_ceil(per_block));
    to_i32(OP, "the number of blocks", n)?;
    Ok(n)
}

/// Errors unless `name` has `want` elements.
fn check_len(name: &str, len: usize, want: usize) -> Result<()> {
    if len != want {
        bail!("{OP}: `{name}` has {len} elements, expected {want}")
    }
    Ok(())
}

/// Element counts `(nq, nkv, nl)` of `q` `[b, s, hq, d]`, `k` `[b, sk, hkv, d]` and the lse
/// `[b, hq, s]`.
fn sizes(dm: Dims) -> (usize, usize, usize) {
    let Dims {
        b,
        s,
        sk,
        hq,
        hkv,
        d,
        ..
    } = dm;
    (b * s * hq * d, b * sk * hkv * d, b * hq * s)
}

/// Forward: returns the output `[b, s, hq, d]` (dtype of `q`) and the log-sum-exp `[b, hq, s]`
/// (f32, or f64 for f64) of the scaled scores.
pub(crate) fn attention_fwd(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    (dm, floor): (Dims, Floor<'_>),
    scale: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    let dtype = q.0.dtype();
    crate::with_cuda_dtype!(OP, dtype, T => fwd::<T>(q, k, v, (dm, floor), scale, dtype))
}

/// A document floor on the device (see [`Floor`]), or none.
fn device_floor(dev: &CudaDevice, floor: Floor<'_>) -> Result<Option<CudaSlice<u32>>> {
    floor.map(|f| dev.clone_htod(f)).transpose()
}

fn fwd<T: KernelFloat>(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    (dm, floor): (Dims, Floor<'_>),
    scale: f64,
    dtype: DType,
) -> Result<(CudaStorage, CudaStorage)> {
    let Ints([b, s, hq, hkv, d, sk, causal]) = Ints::new(dm)?;
    let (nq, nkv, nl) = sizes(dm);
    let dev = q.0.device();
    let (f, cfg, _) = plan(dev, Step::Fwd, dm, dtype, floor.is_some())?;
    let fl = device_floor(dev, floor)?; // [b, s] or none
    let null = 0u64; // a null `const unsigned*`
    let qv = view::<T>(OP, "q", q.0, q.1)?; // [b, s, hq, d]
    let kv = view::<T>(OP, "k", k.0, k.1)?; // [b, sk, hkv, d]
    let vv = view::<T>(OP, "v", v.0, v.1)?; // [b, sk, hkv, d]
    check_len("q", qv.len(), nq)?;
    check_len("k", kv.len(), nkv)?;
    check_len("v", vv.len(), nkv)?;
    // SAFETY: the forward kernel writes every row p < s of every (batch, query head) of `out`
    // (all d columns) and of `lse`, and nothing reads them before.
    let mut out = unsafe { alloc::<T>(dev, nq) }?; // [b, s, hq, d]
    let mut lse = unsafe { alloc::<T::Acc>(dev, nl) }?; // [b, hq, s]
    if nq > 0 {
        let sc = T::acc(scale);
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(&qv).arg(&kv).arg(&vv).arg(&mut out).arg(&mut lse);
        a.arg(&b).arg(&s).arg(&hq).arg(&hkv).arg(&d);
        a.arg(&sk).arg(&causal);
        match &fl {
            Some(fl) => a.arg(fl),
            None => a.arg(&null),
        };
        a.arg(&sc);
        // SAFETY: the arguments match `attn_fwd_d<DMAX>_<T>(const T* q, const T* k, const T* v,
        // T* out, A* lse, int b, int s, int hq, int hkv, int d, int sk, int causal,
        // const unsigned* floor, A scale)` with A = T::Acc (`floor` null, or b·s elements that
        // never decrease along a row, as `check_floor` made sure), and
        // `attn_tc_fwd_d<D>_bf16`, the same list for T = bf16, A = f32 (`plan` picks it only for
        // bf16); the buffers hold nq, nkv, nkv, nq and nl elements, which is what the kernel
        // indexes for these dims; grid and shared memory come from `plan`, as the kernel expects
        // (it traps otherwise).
        unsafe { a.launch(cfg) }.w()?;
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        CudaStorage::wrap_cuda_slice(lse, dev.clone()),
    ))
}

/// Backward: the gradients of `(q, k, v)` given the forward output `out`, its upstream gradient
/// `dout` (both `[b, s, hq, d]`, dtype of `q`) and the forward's log-sum-exp `lse` `[b, hq, s]`
/// (f32, or f64 for f64). Returns the flat `[nq + 2 nkv]` concatenation of dQ `[b, s, hq, d]`,
/// dK and dV `[b, s, hkv, d]` in the dtype of `q`.
pub(crate) fn attention_bwd(
    qkv: [(&CudaStorage, &Layout); 3],
    out: (&CudaStorage, &Layout),
    dout: (&CudaStorage, &Layout),
    lse: (&CudaStorage, &Layout),
    (dm, floor): (Dims, Floor<'_>),
    scale: f64,
) -> Result<CudaStorage> {
    let dtype = qkv[0].0.dtype();
    let mask = (dm, floor);
    crate::with_cuda_dtype!(OP, dtype, T => bwd::<T>(qkv, out, dout, lse, mask, scale, dtype))
}

fn bwd<T: KernelFloat>(
    [q, k, v]: [(&CudaStorage, &Layout); 3],
    out: (&CudaStorage, &Layout),
    dout: (&CudaStorage, &Layout),
    lse: (&CudaStorage, &Layout),
    (dm, floor): (Dims, Floor<'_>),
    scale: f64,
    dtype: DType,
) -> Result<CudaStorage> {
    let Ints([b, s, hq, hkv, d, sk, causal]) = Ints::new(dm)?;
    let (nq, nkv, nl) = sizes(dm);
    let dev = q.0.device();
    let (f_dq, cfg_dq, _) = plan(dev, Step::Dq, dm, dtype, floor.is_some())?;
    let (f_dkv, cfg_dkv, tc_dkv) = plan(dev, Step::Dkv, dm, dtype, floor.is_some())?;
    let fl = device_floor(dev, floor)?; // [b, s] or none
    let null = 0u64; // a null `const unsigned*`
    let qv = view::<T>(OP, "q", q.0, q.1)?; // [b, s, hq, d]
    let kv = view::<T>(OP, "k", k.0, k.1)?; // [b, sk, hkv, d]
    let vv = view::<T>(OP, "v", v.0, v.1)?; // [b, sk, hkv, d]
    let ov = view::<T>(OP, "out", out.0, out.1)?; // [b, s, hq, d]
    let dov = view::<T>(OP, "dout", dout.0, dout.1)?; // [b, s, hq, d]
    let lv = view::<T::Acc>(OP, "lse", lse.0, lse.1)?; // [b, hq, s]
    for (name, len, want) in [
        ("q", qv.len(), nq),
        ("k", kv.len(), nkv),
        ("v", vv.len(), nkv),
        ("out", ov.len(), nq),
        ("dout", dov.len(), nq),
        ("lse", lv.len(), nl),
    ] {
        check_len(name, len, want)?;
    }
    // SAFETY: `attn_bwd_delta` writes every element of `delta` before the dQ and dK/dV kernels
    // (queued after it on the same stream) read it.
    let mut delta = unsafe { alloc::<T::Acc>(dev, nl) }?; // [b, hq, s]

    // SAFETY: the dQ kernel writes every row p < s of every (batch, query head) of dQ, and the
    // dK/dV kernel every row p < sk of every (batch, kv head) of dK and dV, all d columns: every
    // element of the flat buffer.
    let mut grads = unsafe { alloc::<T>(dev, nq + 2 * nkv) }?; // [nq + 2 nkv]
    if nq == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(grads, dev.clone()));
    }
    let sc = T::acc(scale);
    let stream = dev.cuda_stream();

    // delta = Σ dO · O per row: one warp per row of [b, s, hq].
    let warps = (THREADS / 32) as usize;
    let cfg = grid(blocks(1, dm.b * dm.s * dm.hq, warps)?, THREADS, 0);
    let f = kernel(dev, "attn_bwd_delta", dtype)?;
    let mut a = stream.launch_builder(&f);
    a.arg(&ov).arg(&dov).arg(&mut delta);
    a.arg(&b).arg(&s).arg(&hq).arg(&d);
    // SAFETY: matches `attn_bwd_delta_<T>(const T* out, const T* dout, A* delta, int b, int s,
    // int hq, int d)`; one warp per row of `out`/`dout` (nq elements each), writing `delta` (nl
    // elements); warps past the b·s·hq rows return.
    unsafe { a.launch(cfg) }.w()?;

    // dQ: b·hq·ceil(s / rows) blocks.
    let mut a = stream.launch_builder(&f_dq);
    a.arg(&qv).arg(&kv).arg(&vv).arg(&dov);
    a.arg(&lv).arg(&delta).arg(&mut grads);
    a.arg(&b).arg(&s).arg(&hq).arg(&hkv).arg(&d);
    a.arg(&sk).arg(&causal);
    match &fl {
        Some(fl) => a.arg(fl),
        None => a.arg(&null),
    };
    a.arg(&sc);
    // SAFETY: matches `attn_bwd_dq_d<DMAX>_<T>(const T* q, const T* k, const T* v,
    // const T* dout, const A* lse, const A* delta, T* grads, int b, int s, int hq, int hkv,
    // int d, int sk, int causal, const unsigned* floor, A scale)` (`floor` null or b·s
    // non-decreasing rows); the buffers hold nq, nkv, nkv, nq, nl, nl and nq + 2 nkv elements and
    // the kernel writes only the dQ part [0, nq) of `grads`; or `attn_tc_dq_d<D>_bf16`, the same
    // list for T = bf16, A = f32 (`plan` picks it only for bf16); grid and shared memory come
    // from `plan` (the kernel traps otherwise).
    unsafe { a.launch(cfg_dq) }.w()?;

    if tc_dkv {
        return tc_dkv_launch(
            dev,
            &f_dkv,
            cfg_dkv,
            [&qv, &kv, &vv, &dov],
            &lv,
            &delta,
            grads,
            dm,
            sc,
        );
    }
    // dK, dV: b·hkv·ceil(sk / keys) blocks.
    let mut a = stream.launch_builder(&f_dkv);
    a.arg(&qv).arg(&kv).arg(&vv).arg(&dov);
    a.arg(&lv).arg(&delta).arg(&mut grads);
    a.arg(&b).arg(&s).arg(&hq).arg(&hkv).arg(&d);
    a.arg(&sk).arg(&causal);
    match &fl {
        Some(fl) => a.arg(fl),
        None => a.arg(&null),
    };
    a.arg(&sc);
    // SAFETY: same parameter list and buffers as the dQ kernel; this one writes only the dK and
    // dV parts [nq, nq + 2 nkv) of `grads`; grid and shared memory come from `plan` (the kernel
    // traps otherwise).
    unsafe { a.launch(cfg_dkv) }.w()?;

    Ok(CudaStorage::wrap_cuda_slice(grads, dev.clone()))
}

/// The tensor-core dK/dV kernel (b·hq·ceil(s / 64) blocks, one query head each) and, with GQA,
/// the reduction of its per-query-head f32 shares `part` (`[2, b, sk, hq, d]`) over each group in
/// head order into the dK and dV parts of `grads`.
#[allow(clippy::too_many_arguments)]
fn tc_dkv_launch<T: KernelFloat>(
    dev: &CudaDevice,
    f: &CudaFunction,
    cfg: LaunchConfig,
    [qv, kv, vv, dov]: [&CudaView<'_, T>; 4],
    lv: &CudaView<'_, T::Acc>,
    delta: &CudaSlice<T::Acc>,
    mut grads: CudaSlice<T>,
    dm: Dims,
    sc: T::Acc,
) -> Result<CudaStorage> {
    let Ints([b, s, hq, hkv, d, sk, causal]) = Ints::new(dm)?;
    let stream = dev.cuda_stream();
    let gqa = dm.hq != dm.hkv;
    // SAFETY: with GQA the dK/dV kernel writes every row p < sk of every (batch, query head) of
    // both shares before the reduction (queued after it on the same stream) reads them; without
    // GQA the kernel writes `grads` itself and never touches `part`.
    let np = dm.b * dm.sk * dm.hq * dm.d; // one share: [b, sk, hq, d]
    let mut part = unsafe { alloc::<f32>(dev, if gqa { 2 * np } else { 1 }) }?;
    let mut a = stream.launch_builder(f);
    a.arg(qv).arg(kv).arg(vv).arg(dov);
    a.arg(lv).arg(delta).arg(&mut grads);
    if gqa {
        a.arg(&mut part);
    } else {
        a.arg(&0u64); // a null pointer: the kernel writes dK, dV itself
    }
    a.arg(&b).arg(&s).arg(&hq).arg(&hkv).arg(&d);
    // A null floor: `plan` picks none with one.
    a.arg(&sk).arg(&causal).arg(&0u64).arg(&sc);
    // SAFETY: matches `attn_tc_dkv_d<D>_bf16(const bf16* q, const bf16* k, const bf16* v,
    // const bf16* dout, const float* lse, const float* delta, bf16* grads, float* part, int b,
    // int s, int hq, int hkv, int d, int sk, int causal, const unsigned* floor, float scale)`
    // (`plan` picks it only for bf16, so T::Acc = f32); buffers as for the dQ kernel, `part`
    // holds 2 np floats with GQA (the kernel traps on a null `part` with GQA); grid and shared
    // memory come from `plan`.
    unsafe { a.launch(cfg) }.w()?;
    if gqa {
        let f = load(dev, Module::AttentionTc, "attn_tc_dkv_reduce_bf16")?;
        let mut a = stream.launch_builder(&f);
        a.arg(&part).arg(&mut grads);
        a.arg(&b)
            .arg(&s)
            .arg(&hq)
            .arg(&hkv)
            .arg(&d)
            .arg(&sk)
            .arg(&sc);
        // SAFETY: matches `attn_tc_dkv_reduce_bf16(const float* part, bf16* grads, int b, int s,
        // int hq, int hkv, int d, int sk, float scale)`: it reads 2 np floats of `part` and
        // writes the 2 nkv elements of `grads` after its first nq; grid-stride, so any grid
        // covers them.
        unsafe { a.launch(super::elementwise(2 * dm.b * dm.sk * dm.hkv * dm.d)) }.w()?;
    }
    Ok(CudaStorage::wrap_cuda_slice(grads, dev.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The geometry of the `Cfg` table in attention.cu (rows, keys, tile per bucket and type).
    #[test]
    fn geometry_matches_kernels() {
        for (d, acc, rows, keys, tile, ld) in [
            (64, 4, 64, 32, 64, 64),
            (128, 4, 32, 16, 32, 128),
            (80, 4, 32, 16, 32, 96),
            (256, 4, 16, 8, 16, 256),
            (200, 4, 16, 8, 16, 256),
            (64, 8, 32, 16, 32, 64),
            (8, 8, 32, 16, 32, 16),
            (128, 8, 16, 8, 16, 128),
            (256, 8, 8, 4, 8, 256),
        ] {
            let g = Geometry::new(d, acc).unwrap();
            assert_eq!(
                (g.rows, g.keys, g.tile, g.ld),
                (rows, keys, tile, ld),
                "d {d} acc {acc}"
            );
            assert!(g.qdo_smem() <= 48 * 1024 && g.kv_smem() <= 48 * 1024);
        }
        assert!(Geometry::new(257, 4).is_err());
        assert!(Geometry::new(0, 4).is_err());
    }
}
