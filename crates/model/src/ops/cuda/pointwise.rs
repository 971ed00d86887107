//! Launchers of the pointwise kernels (`kernels/pointwise.cu`): RoPE, SwiGLU, the addition,
//! cross-entropy and the embedding's backward (RMSNorm's are in `norm.rs`), forward and backward, on contiguous f32, f64 or bf16 CUDA storage. The op
//! files call these from their `cuda_fwd`; shapes have been checked by the op wrappers, and every
//! launcher re-checks the buffer lengths its kernel indexes with before launching.
//!
//! Launch shapes: row kernels use one block of [`ROW_THREADS`] (cross-entropy: [`CE_THREADS`])
//! threads per row; elementwise kernels use [`super::elementwise`] with grid-stride loops.
//! Sums run in f32 (f64 for f64 storage) in a fixed order, so results are reproducible.
//!
//! A cross-entropy target `>= v` gives its row a NaN loss (and NaN gradients): nothing is read
//! back to the host, so the launches never wait for the device; the training loop's non-finite
//! policy meets the NaN in the step's loss (the data loader has already checked every target
//! against the vocabulary). The cross-entropy kernels declare their 1,024-thread blocks
//! (`__launch_bounds__`, [`CE_THREADS`]).

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaFunction, PushKernelArg};
use candle_core::cuda::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{bail, DType, Layout, Result};

use super::{
    alloc, elementwise, grid, kernel_name, load, to_i32, view, zeros, KernelFloat, Module,
};

/// Threads per block of the RMSNorm row kernels.
pub const ROW_THREADS: u32 = 256;

/// Threads per block of the cross-entropy row kernels (rows are whole vocabularies).
pub const CE_THREADS: u32 = 1024; // = __launch_bounds__ of the cross-entropy kernels

/// Kernel `<base>_<dtype>` of the pointwise module (`op` names the op in errors).
pub(super) fn kernel(dev: &CudaDevice, op: &str, base: &str, dtype: DType) -> Result<CudaFunction> {
    load(dev, Module::Pointwise, &kernel_name(op, base, dtype)?)
}

/// Errors unless `len == want`, naming `op` and the argument.
pub(super) fn check_len(op: &str, name: &str, len: usize, want: usize) -> Result<()> {
    if len != want {
        bail!("{op}: `{name}` has {len} elements, expected {want}")
    }
    Ok(())
}

/// RoPE on `x` `[b, s, heads, d]` with `cos`, `sin` `[s, d / 2]` in the dtype of `x`; the
/// inverse rotation (sin negated) when `inverse`. Returns `y` like `x`.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &CudaStorage,
    xl: &Layout,
    cos: &CudaStorage,
    cl: &Layout,
    sin: &CudaStorage,
    sl: &Layout,
    inverse: bool,
) -> Result<CudaStorage> {
    const OP: &str = "rope";
    let dev = x.device();
    let &[_, s, heads, d] = xl.dims() else {
        bail!("{OP}: `x` must be [b, s, heads, d], got {:?}", xl.dims())
    };
    if d % 2 != 0 {
        bail!("{OP}: the head dim of `x` {:?} must be even", xl.dims())
    }
    let half = d / 2;
    // `[s, half]`, or `[b, s, half]` per sample: row r of x's b·s rows reads table row
    // r mod (table rows), which the kernel computes as `(t / heads) % seq`.
    let b = xl.dims()[0];
    let rows = cl.shape().elem_count() / half.max(1);
    let s = if rows == b * s && b > 1 { rows } else { s };
    check_len(OP, "cos", cl.shape().elem_count(), s * half)?;
    check_len(OP, "sin", sl.shape().elem_count(), s * half)?;
    let n = xl.shape().elem_count();
    let pairs = n / 2;
    let (s_i, heads_i, half_i) = (
        to_i32(OP, "s", s)?,
        to_i32(OP, "heads", heads)?,
        to_i32(OP, "d", half)?,
    );
    let (pairs_u, inverse_i) = (pairs as u64, i32::from(inverse));
    crate::with_cuda_dtype!(OP, x.dtype(), T => {
        let xv = view::<T>(OP, "x", x, xl)?; // [b, s, heads, d]
        let cv = view::<T>(OP, "cos", cos, cl)?; // [s, d / 2] or [b, s, d / 2]
        let sv = view::<T>(OP, "sin", sin, sl)?;
        // SAFETY: pair `p` writes both of its elements, and the pairs cover `x`.
        let mut y = unsafe { alloc::<T>(dev, n) }?; // [b, s, heads, d]
        if pairs > 0 {
            let f = kernel(dev, OP, "rope", x.dtype())?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&cv).arg(&sv).arg(&mut y);
            b.arg(&pairs_u).arg(&s_i).arg(&heads_i).arg(&half_i).arg(&inverse_i);
            // A thread a pack of pairs where the kernel takes packs (half a multiple of a pack,
            // every buffer at a pack boundary of its allocation), else a thread a pair.
            let pack = 16 / std::mem::size_of::<T>();
            let at_pack = |l: &Layout| l.start_offset().is_multiple_of(pack);
            let packed = half.is_multiple_of(pack) && at_pack(xl) && at_pack(cl) && at_pack(sl);
            let units = if packed { pairs / pack } else { pairs };
            // SAFETY: matches `rope_<T>(const T*, const T*, const T*, T*, u64, int, int, int,
            // int)`; pair `p < b s heads half` touches x/y at (p / half) d + p % half (+ half)
            // < n and cos/sin at pos half + p % half < s half (a pack of pairs, N of them from
            // a multiple of N within one half, the same elements 16 bytes at a time); any grid
            // covers them (grid-stride).
            unsafe { b.launch(elementwise(units)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })
}

/// One thread per 16-byte pack of `n` elements of `T` (the element kernels' `Pack`).
fn packs<T>(n: usize) -> usize {
    n.div_ceil(16 / std::mem::size_of::<T>())
}

/// `a + b` for two contiguous tensors of `n` elements each (`add` in kernels/pointwise.cu).
pub fn add(a: &CudaStorage, al: &Layout, b: &CudaStorage, bl: &Layout) -> Result<CudaStorage> {
    const OP: &str = "add";
    let dev = a.device();
    let n = al.shape().elem_count();
    check_len(OP, "b", bl.shape().elem_count(), n)?;
    if a.dtype() != b.dtype() {
        bail!("{OP}: a is {:?} but b is {:?}", a.dtype(), b.dtype())
    }
    let n_u = n as u64;
    crate::with_cuda_dtype!(OP, a.dtype(), T => {
        let av = view::<T>(OP, "a", a, al)?; // [n]
        let bv = view::<T>(OP, "b", b, bl)?; // [n]
        // SAFETY: the grid-stride loops write every element `i < n`.
        let mut out = unsafe { alloc::<T>(dev, n) }?; // [n]
        if n > 0 {
            let f = kernel(dev, OP, "add", a.dtype())?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&f);
            builder.arg(&av).arg(&bv).arg(&mut out).arg(&n_u);
            // SAFETY: matches `add_<T>(const T*, const T*, T*, u64)`; indices `i < n`.
            unsafe { builder.launch(elementwise(packs::<T>(n))) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })
}

/// SwiGLU forward: `gate * sigmoid(gate) * up`, elementwise; returns `y` like `gate`.
pub fn swiglu_fwd(
    gate: &CudaStorage,
    gl: &Layout,
    up: &CudaStorage,
    ul: &Layout,
) -> Result<CudaStorage> {
    const OP: &str = "swiglu";
    let dev = gate.device();
    let n = gl.shape().elem_count();
    check_len(OP, "up", ul.shape().elem_count(), n)?;
    let n_u = n as u64;
    crate::with_cuda_dtype!(OP, gate.dtype(), T => {
        let gv = view::<T>(OP, "gate", gate, gl)?; // [n]
        let uv = view::<T>(OP, "up", up, ul)?; // [n]
        // SAFETY: the grid-stride loop writes every element `i < n`.
        let mut y = unsafe { alloc::<T>(dev, n) }?; // [n]
        if n > 0 {
            let f = kernel(dev, OP, "swiglu_fwd", gate.dtype())?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&gv).arg(&uv).arg(&mut y).arg(&n_u);
            // SAFETY: matches `swiglu_fwd_<T>(const T*, const T*, T*, u64)`; indices `i < n`.
            unsafe { b.launch(elementwise(packs::<T>(n))) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })
}

/// SwiGLU backward on `(gate, up, grad)` (same element counts): returns the flat `[2, n]`
/// `[d gate, d up]`.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_bwd(
    gate: &CudaStorage,
    gl: &Layout,
    up: &CudaStorage,
    ul: &Layout,
    grad: &CudaStorage,
    dl: &Layout,
) -> Result<CudaStorage> {
    const OP: &str = "swiglu";
    let dev = gate.device();
    let n = gl.shape().elem_count();
    check_len(OP, "up", ul.shape().elem_count(), n)?;
    check_len(OP, "grad", dl.shape().elem_count(), n)?;
    let n_u = n as u64;
    crate::with_cuda_dtype!(OP, gate.dtype(), T => {
        let gv = view::<T>(OP, "gate", gate, gl)?; // [n]
        let uv = view::<T>(OP, "up", up, ul)?; // [n]
        let dv = view::<T>(OP, "grad", grad, dl)?; // [n]
        // SAFETY: element `i < n` writes out[i] and out[n + i].
        let mut out = unsafe { alloc::<T>(dev, 2 * n) }?; // [2, n]
        if n > 0 {
            let f = kernel(dev, OP, "swiglu_bwd", gate.dtype())?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&gv).arg(&uv).arg(&dv).arg(&mut out).arg(&n_u);
            // SAFETY: matches `swiglu_bwd_<T>(const T*, const T*, const T*, T*, u64)`; reads
            // indices `i < n`, writes `i` and `n + i < 2 n`.
            unsafe { b.launch(elementwise(packs::<T>(n))) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })
}

/// SwiGLU of the joined `gu` `[rows, 2f]` (each row's gate, then its up): `[rows, f]`.
pub fn swiglu_joined_fwd(gu: &CudaStorage, gl: &Layout, f: usize) -> Result<CudaStorage> {
    const OP: &str = "swiglu";
    let dev = gu.device();
    let n = gl.shape().elem_count() / 2; // rows · f
    let (rows, f_u) = ((n / f.max(1)) as u64, f as u64);
    crate::with_cuda_dtype!(OP, gu.dtype(), T => {
        let v = view::<T>(OP, "gate|up", gu, gl)?; // [rows, 2f]
        // SAFETY: the grid-stride loop writes every element `i < rows · f`.
        let mut y = unsafe { alloc::<T>(dev, n) }?; // [rows, f]
        if n > 0 {
            let k = kernel(dev, OP, "swiglu_joined_fwd", gu.dtype())?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&k);
            b.arg(&v).arg(&mut y).arg(&rows).arg(&f_u);
            // SAFETY: matches `swiglu_joined_fwd_<T>(const T*, T*, u64, u64)`; reads indices
            // below rows · 2f, writes below rows · f.
            unsafe { b.launch(elementwise(n)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })
}

/// The gradient of [`swiglu_joined_fwd`] for `grad` `[rows, f]`: `[rows, 2f]`, each row's
/// `d gate`, then its `d up`.
pub fn swiglu_joined_bwd(
    gu: &CudaStorage,
    gl: &Layout,
    grad: &CudaStorage,
    dl: &Layout,
    f: usize,
) -> Result<CudaStorage> {
    const OP: &str = "swiglu";
    let dev = gu.device();
    let n = gl.shape().elem_count() / 2; // rows · f
    check_len(OP, "grad", dl.shape().elem_count(), n)?;
    let (rows, f_u) = ((n / f.max(1)) as u64, f as u64);
    crate::with_cuda_dtype!(OP, gu.dtype(), T => {
        let v = view::<T>(OP, "gate|up", gu, gl)?; // [rows, 2f]
        let dv = view::<T>(OP, "grad", grad, dl)?; // [rows, f]
        // SAFETY: element `i < rows · f` writes its row's d gate and d up: all 2 · rows · f.
        let mut out = unsafe { alloc::<T>(dev, 2 * n) }?; // [rows, 2f]
        if n > 0 {
            let k = kernel(dev, OP, "swiglu_joined_bwd", gu.dtype())?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&k);
            b.arg(&v).arg(&dv).arg(&mut out).arg(&rows).arg(&f_u);
            // SAFETY: matches `swiglu_joined_bwd_<T>(const T*, const T*, T*, u64, u64)`;
            // indices below rows · 2f.
            unsafe { b.launch(elementwise(n)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })
}

/// The `(rows, v)` of `logits` `[n, v]`, and the rows' `i32` kernel arguments.
fn ce_dims(op: &str, ll: &Layout, tl: &Layout) -> Result<(usize, usize, i32, i32)> {
    let &[n, v] = ll.dims() else {
        bail!("{op}: `logits` must be [n, v], got {:?}", ll.dims())
    };
    check_len(op, "targets", tl.shape().elem_count(), n)?;
    if v == 0 && n > 0 {
        bail!("{op}: `logits` {:?} has no classes", ll.dims())
    }
    Ok((n, v, to_i32(op, "n", n)?, to_i32(op, "v", v)?))
}

/// Cross-entropy forward: `logits` `[n, v]`, `targets` `[n]` u32; returns the `[n]` losses in
/// the accumulation dtype ([`super::acc_dtype`]: f32 for bf16 logits), so the backward pass recovers
/// each row's log-sum-exp in full precision. A target `>= v` gives a NaN loss (nothing is read
/// back to check it: see `kernels/pointwise.cu`).
pub fn cross_entropy_fwd(
    logits: &CudaStorage,
    ll: &Layout,
    targets: &CudaStorage,
    tl: &Layout,
) -> Result<CudaStorage> {
    const OP: &str = "cross_entropy";
    let dev = logits.device();
    let (n, _, n_i, v_i) = ce_dims(OP, ll, tl)?;
    crate::with_cuda_dtype!(OP, logits.dtype(), T => {
        let lv = view::<T>(OP, "logits", logits, ll)?; // [n, v]
        let tv = view::<u32>(OP, "targets", targets, tl)?; // [n]
        // SAFETY: block `r` writes loss[r] (NaN for a target >= v).
        let mut loss = unsafe { alloc::<<T as KernelFloat>::Acc>(dev, n) }?; // [n]
        if n > 0 {
            let f = kernel(dev, OP, "cross_entropy_fwd", logits.dtype())?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&lv).arg(&tv).arg(&mut loss).arg(&n_i).arg(&v_i);
            // SAFETY: matches `cross_entropy_fwd_<T>(const T*, const unsigned*, Acc*, int,
            // int)`; block `r < n` reads row `r` of logits ([n, v]) at columns < v (its target
            // only once checked `< v`) and targets[r], and writes loss[r].
            unsafe { b.launch(grid(n, CE_THREADS, 0)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(loss, dev.clone()))
    })
}

/// Cross-entropy backward on `(logits [n, v], targets [n], loss_grad [n, 2])`, `loss_grad` in
/// the accumulation dtype (the forward losses and their upstream gradients); returns `dlogits`
/// `[n, v]` in the dtype of `logits`. A target `>= v` gives a NaN row.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_bwd(
    logits: &CudaStorage,
    ll: &Layout,
    targets: &CudaStorage,
    tl: &Layout,
    loss_grad: &CudaStorage,
    gl: &Layout,
) -> Result<CudaStorage> {
    const OP: &str = "cross_entropy";
    let dev = logits.device();
    let (n, v, n_i, v_i) = ce_dims(OP, ll, tl)?;
    check_len(OP, "loss/grad", gl.shape().elem_count(), 2 * n)?;
    crate::with_cuda_dtype!(OP, logits.dtype(), T => {
        let lv = view::<T>(OP, "logits", logits, ll)?; // [n, v]
        let tv = view::<u32>(OP, "targets", targets, tl)?; // [n]
        let gv = view::<<T as KernelFloat>::Acc>(OP, "loss/grad", loss_grad, gl)?; // [n, 2]
        // SAFETY: block `r` writes row `r` (NaN for a target >= v).
        let mut d = unsafe { alloc::<T>(dev, n * v) }?; // [n, v]
        if n > 0 {
            let f = kernel(dev, OP, "cross_entropy_bwd", logits.dtype())?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&lv).arg(&tv).arg(&gv).arg(&mut d).arg(&n_i).arg(&v_i);
            // SAFETY: matches `cross_entropy_bwd_<T>(const T*, const unsigned*, const Acc*, T*,
            // int, int)`; block `r < n` reads row `r` of logits and writes row `r` of d ([n, v],
            // columns < v), reads targets[r] and loss_grad[2r..2r+2] ([n, 2]).
            unsafe { b.launch(grid(n, CE_THREADS, 0)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(d, dev.clone()))
    })
}

/// Embedding backward for a `[v, h]` table: `grad` `[n, h]` and `ids` `[n]` u32 give `dw`
/// `[v, h]`, each row the sum of its positions' gradient rows in position order: a stable
/// counting sort of the positions by id (`embedding_count`, `embedding_offsets`,
/// `embedding_order`), then one block per row (`embedding_bwd`; see `kernels/pointwise.cu`).
/// Ids `>= v` contribute nothing.
pub fn embedding_bwd(
    grad: &CudaStorage,
    gl: &Layout,
    ids: &CudaStorage,
    il: &Layout,
    v: usize,
) -> Result<CudaStorage> {
    const OP: &str = "embedding";
    /// `EMB_SCAN_THREADS` and `EMB_ORDER_THREADS` in kernels/pointwise.cu.
    const SCAN_THREADS: usize = 1024;
    const ORDER_THREADS: usize = 256;
    let dev = grad.device();
    let n = il.shape().elem_count();
    let h = *gl.dims().last().unwrap_or(&0);
    check_len(OP, "grad", gl.shape().elem_count(), n * h)?;
    // Positions and slots are u32 in the kernels; offsets[v] counts positions.
    if u32::try_from(n).is_err() {
        candle_core::bail!(
            "{OP}: {n} positions in one micro-batch, more than the {} the CUDA kernels index",
            u32::MAX
        );
    }
    let (h_i, v_i, v_u) = (
        to_i32(OP, "h", h)?,
        to_i32(OP, "vocabulary", v)?,
        u32::try_from(v).unwrap_or(u32::MAX),
    );
    let n_u = n as u64;
    let iv = view::<u32>(OP, "ids", ids, il)?; // [n]
    let mut counts = zeros::<u32>(dev, v)?; // [v]
    let mut offsets = zeros::<u32>(dev, v + 1)?; // [v + 1]
    let mut order = zeros::<u32>(dev, n.max(1))?; // [n]
    let stream = dev.cuda_stream();
    if n > 0 && v > 0 {
        let f = load(dev, Module::Pointwise, "embedding_count")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&iv).arg(&mut counts).arg(&n_u).arg(&v_u);
        // SAFETY: matches `embedding_count(const unsigned*, unsigned*, u64, unsigned)`; reads
        // ids[i < n], increments counts[id] only for id < v.
        unsafe { b.launch(elementwise(n)) }.w()?;
    }
    if v > 0 {
        let f = load(dev, Module::Pointwise, "embedding_offsets")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&counts).arg(&mut offsets).arg(&v_u);
        let threads = v.next_multiple_of(32).min(SCAN_THREADS) as u32;
        // SAFETY: matches `embedding_offsets(const unsigned*, unsigned*, unsigned)`; one block of
        // at most EMB_SCAN_THREADS threads reads counts[0..v] and writes offsets[0..=v].
        unsafe { b.launch(grid(1, threads, 0)) }.w()?;
    }
    if n > 0 && v > 0 {
        let f = load(dev, Module::Pointwise, "embedding_order")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&iv).arg(&offsets).arg(&mut order).arg(&n_u).arg(&v_u);
        // SAFETY: matches `embedding_order(const unsigned*, const unsigned*, unsigned*, u64,
        // unsigned)` with blocks of EMB_ORDER_THREADS; reads ids[0..n] and offsets[id], writes
        // order[offsets[id] + rank] < offsets[v] <= n for each position with id < v.
        unsafe { b.launch(grid(n.div_ceil(ORDER_THREADS), ORDER_THREADS as u32, 0)) }.w()?;
    }
    crate::with_cuda_dtype!(OP, grad.dtype(), T => {
        let gv = view::<T>(OP, "grad", grad, gl)?; // [n, h]
        // SAFETY: block `id < v` writes row `id` of dw (all h columns).
        let mut dw = unsafe { alloc::<T>(dev, v * h) }?; // [v, h]
        if v > 0 && h > 0 {
            let f = kernel(dev, OP, "embedding_bwd", grad.dtype())?;
            let mut b = stream.launch_builder(&f);
            b.arg(&gv).arg(&order).arg(&offsets).arg(&mut dw).arg(&h_i).arg(&v_i);
            let threads = h.next_multiple_of(32).min(1024) as u32;
            // SAFETY: matches `embedding_bwd_<T>(const T*, const unsigned*, const unsigned*, T*,
            // int, int)`; block `id < v` reads offsets[id..=id + 1], order[offsets[id]..
            // offsets[id + 1]] (positions < n) and their rows of grad, and writes dw[id, 0..h].
            unsafe { b.launch(grid(v, threads, 0)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(dw, dev.clone()))
    })
}
