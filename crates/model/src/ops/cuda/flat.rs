//! Launchers of the optimizer's flat-buffer kernels (`kernels/flat.cu`), called from the root
//! crate's `optim::kernels` ops: gradient accumulation into an f32 buffer (the cuBLAS products
//! into it are in `products.rs`), the AdamW update over `[master | exp_avg | exp_avg_sq]`
//! (moments f32 or bf16) and the sum of squares of an f32 or bf16 buffer (in f64).
//!
//! `adamw` performs exactly the f32 operations of the CPU `AdamWStep` (bitwise equal results);
//! `sum_squares` is a deterministic two-stage reduction (a grid of [`SUM_BLOCKS`] or fewer
//! blocks, its size a function of the length only, reading 16 bytes at a time from the
//! buffer's first aligned element, then one block), so equal inputs at equal offsets give equal
//! norms on every run.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaFunction, PushKernelArg};
use candle_core::cuda::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{bail, DType, Layout, Result};

use super::{alloc, elementwise, grid, kernel_name, load, view, Module};

/// Most blocks of the first stage of [`sum_squares`] (one f64 partial each).
pub const SUM_BLOCKS: usize = 1024;

/// Threads per block of both stages of [`sum_squares`].
const SUM_THREADS: u32 = 256;

/// Kernel `name` of the flat module.
pub(super) fn kernel(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    load(dev, Module::Flat, name)
}

/// `[start, end)` of a contiguous layout; errors naming `op` and the argument otherwise.
pub(super) fn range(op: &str, name: &str, l: &Layout) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{op}: `{name}` must be contiguous (layout {l:?})"),
    }
}

/// The element range of a gradient slot `[out, in]` of an f32 buffer view `dl` (contiguous, of
/// `out × in` elements).
pub(super) fn slot_range(
    op: &str,
    dl: &Layout,
    (out, inp): (usize, usize),
) -> Result<(usize, usize)> {
    let (a, b) = range(op, "buffer", dl)?;
    if b - a != out * inp {
        bail!("{op}: buffer slice of {} for [{out}, {inp}]", b - a)
    }
    Ok((a, b))
}

/// Elements `a..b` of the f32 buffer `dst`, to write.
pub(super) fn f32_slot<'a>(
    op: &str,
    dst: &'a mut CudaStorage,
    (a, b): (usize, usize),
) -> Result<candle_core::cuda::cudarc::driver::CudaViewMut<'a, f32>> {
    let dtype = dst.dtype();
    match dst.as_cuda_slice_mut::<f32>() {
        Ok(d) => Ok(d.slice_mut(a..b)),
        Err(_) => bail!("{op}: expected an f32 buffer, got {dtype:?}"),
    }
}

/// `dst ← src` rounded to `dst`'s dtype (f32, f64 or bf16; nearest even): `dst` a view of the
/// parameters' flat tensor (any offset), `src` f32 with the same number of elements.
pub fn cast_into(dst: &mut CudaStorage, dl: &Layout, src: &CudaStorage, sl: &Layout) -> Result<()> {
    const OP: &str = "cast-into";
    let dev = dst.device().clone();
    let (a, b) = range(OP, "parameters", dl)?;
    let n = b - a;
    let sv = view::<f32>(OP, "masters", src, sl)?; // [n]
    if sv.len() != n {
        bail!("{OP}: {} values into {n} elements", sv.len())
    }
    if n == 0 {
        return Ok(());
    }
    let n_u = n as u64;
    let f = kernel(&dev, &kernel_name(OP, "cast_into", dst.dtype())?)?;
    crate::with_cuda_dtype!(OP, dst.dtype(), T => {
        let data = dst.as_cuda_slice_mut::<T>()?;
        let mut d = data.slice_mut(a..b); // [n]
        let stream = dev.cuda_stream();
        let mut builder = stream.launch_builder(&f);
        builder.arg(&mut d).arg(&sv).arg(&n_u);
        // SAFETY: matches `cast_into_<T>(T*, const float*, u64)`; both views hold n elements
        // and the kernel touches indices `i < n`.
        unsafe { builder.launch(elementwise(n)) }.w()?;
        Ok(())
    })
}

/// `dst += src` elementwise, or with `overwrite` `dst = src` (the old values never read):
/// `dst` an f32 buffer view (any offset), `src` f32, f64 or bf16 with the same number of
/// elements.
pub fn add_into(
    dst: &mut CudaStorage,
    dl: &Layout,
    src: &CudaStorage,
    sl: &Layout,
    overwrite: bool,
) -> Result<()> {
    const OP: &str = "add-into";
    let dev = dst.device().clone();
    let (a, b) = range(OP, "buffer", dl)?;
    let n = b - a;
    if sl.shape().elem_count() != n {
        bail!(
            "{OP}: gradient has {} elements, buffer slice {n}",
            sl.shape().elem_count()
        )
    }
    if n == 0 {
        return Ok(());
    }
    let n_u = n as u64;
    let name = kernel_name(OP, "add_into", src.dtype())?;
    let f = kernel(&dev, &name)?;
    let dtype = dst.dtype();
    let data = match dst.as_cuda_slice_mut::<f32>() {
        Ok(d) => d,
        Err(_) => bail!("{OP}: expected an f32 buffer, got {dtype:?}"),
    };
    let mut d = data.slice_mut(a..b); // [n]
    crate::with_cuda_dtype!(OP, src.dtype(), T => {
        let s = view::<T>(OP, "gradient", src, sl)?; // [n]
        let stream = dev.cuda_stream();
        let mut builder = stream.launch_builder(&f);
        let overwrite = i32::from(overwrite);
        builder.arg(&mut d).arg(&s).arg(&n_u).arg(&overwrite);
        // SAFETY: matches `add_into_<T>(float*, const T*, u64, int)`; both views hold n
        // elements and the kernel touches indices `i < n`.
        unsafe { builder.launch(elementwise(n)) }.w()?;
        Ok(())
    })
}

/// The step-wide scalars of one AdamW update, as the CPU `AdamWStep` computes them (f32).
#[derive(Debug, Clone, Copy)]
pub struct AdamWScalars {
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `1 / sqrt(1 - beta2^step)`.
    pub inv_sqrt_bc2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Factor applied to every gradient first (global-norm clipping).
    pub grad_scale: f32,
}

/// One AdamW step in place over `state` (f32 words: the master weights `[n]`, then
/// `exp_avg` and `exp_avg_sq` `[n]` each of dtype `moments`, f32 or bf16, packed into the
/// words that follow) with gradients `grad` `[n]` f32. `ranges` are `(start, len, keep)` in
/// `[0, n)`, `keep` the decoupled weight-decay factor `1 - lr · wd` of the range; elements
/// outside every range are left unchanged. Adjacent ranges with equal `keep` share one launch.
/// A stored value that is not finite sets the `u32` word `bad` to 1 (it is never cleared here).
/// With `params` (bf16 `[n]`), each new master weight in a range is also written there rounded
/// to nearest even, in the same pass: the parameters without a second pass over the masters.
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    state: &mut CudaStorage,
    sl: &Layout,
    grad: &CudaStorage,
    gl: &Layout,
    s: &AdamWScalars,
    ranges: &[(usize, usize, f32)],
    moments: DType,
    ((bad, bl), params): ((&CudaStorage, &Layout), Option<(&CudaStorage, &Layout)>),
) -> Result<()> {
    const OP: &str = "adamw";
    let bad = view::<u32>(OP, "non-finite flag", bad, bl)?; // [1]
    if bad.len() != 1 {
        bail!(
            "{OP}: the non-finite flag has {} words, expected 1",
            bad.len()
        )
    }
    let params = match params {
        Some((p, pl)) => Some(view::<half::bf16>(OP, "parameters", p, pl)?), // [n]
        None => None,
    };
    let dev = state.device().clone();
    let (a, b) = range(OP, "state", sl)?;
    let g = view::<f32>(OP, "gradient", grad, gl)?; // [n]
    let n = g.len();
    let words = match moments {
        DType::F32 => 3 * n,
        DType::BF16 => 2 * n,
        d => bail!("{OP}: moments of dtype {d:?} (f32 or bf16 are supported)"),
    };
    if b - a != words {
        bail!(
            "{OP}: state has {} words, expected {words} for {n} elements with {moments:?} moments",
            b - a
        )
    }
    let mut merged: Vec<(usize, usize, f32)> = Vec::with_capacity(ranges.len());
    for &(start, len, keep) in ranges {
        if start.checked_add(len).is_none_or(|end| end > n) {
            bail!("{OP}: decay range {start}..{start}+{len} exceeds the {n} elements")
        }
        match merged.last_mut() {
            Some(last) if last.0 + last.1 == start && last.2.to_bits() == keep.to_bits() => {
                last.1 += len
            }
            _ => merged.push((start, len, keep)),
        }
    }
    let f = kernel(&dev, &kernel_name(OP, "adamw", moments)?)?;
    let dtype = state.dtype();
    let data = match state.as_cuda_slice_mut::<f32>() {
        Ok(d) => d,
        Err(_) => bail!("{OP}: expected an f32 state, got {dtype:?}"),
    };
    let mut st = data.slice_mut(a..b); // [words]
    if let Some(p) = &params {
        if p.len() != n {
            bail!("{OP}: {} parameters for {n} master weights", p.len())
        }
    }
    let stream = dev.cuda_stream();
    let n_u = n as u64;
    let null = 0u64; // a null `out`: no parameters written
    for (start, len, keep) in merged.into_iter().filter(|r| r.1 > 0) {
        let (start_u, len_u) = (start as u64, len as u64);
        let mut builder = stream.launch_builder(&f);
        builder
            .arg(&mut st)
            .arg(&g)
            .arg(&n_u)
            .arg(&start_u)
            .arg(&len_u);
        builder
            .arg(&s.beta1)
            .arg(&s.beta2)
            .arg(&s.step_size)
            .arg(&s.inv_sqrt_bc2);
        builder.arg(&s.eps).arg(&s.grad_scale).arg(&keep).arg(&bad);
        match &params {
            Some(p) => builder.arg(p),
            None => builder.arg(&null),
        };
        // SAFETY: matches `adamw_{f32,bf16}(float*, const float*, u64, u64, u64, float × 7,
        // unsigned*, __nv_bfloat16*)`; the kernel touches indices start + i < start + len <= n
        // of grad ([n]), of the master weights (the first n words) and of the two [n] moment
        // arrays after them, which end at word n + 2 n · size(moments) / 4 = `words` (checked
        // above), of the parameters ([n], checked above; a null pointer writes none), and may
        // write 1 into the flag's one word. The flag and the parameters are device memory the
        // host does not touch while the kernel runs (it reads the flag once the update is
        // done), and the parameters' other users are kernels on this same stream, ordered
        // before or after the update: the caller holds only a read lock on the parameters'
        // storage, and nothing else writes it meanwhile (stage 0, one stream).
        unsafe { builder.launch(elementwise(len)) }.w()?;
    }
    Ok(())
}

/// `Σ x²` of a contiguous f32 buffer, accumulated in f64, its words read as elements of
/// `elems` (f32, or bf16 two to a word: the optimizer's packed moments); returns a one-element
/// f64 storage.
pub fn sum_squares(x: &CudaStorage, xl: &Layout, elems: DType) -> Result<CudaStorage> {
    const OP: &str = "sum-squares";
    let dev = x.device();
    let xv = view::<f32>(OP, "buffer", x, xl)?; // [words]
    let n = match elems {
        DType::F32 => xv.len(),
        DType::BF16 => 2 * xv.len(),
        d => bail!("{OP}: elements of dtype {d:?} (f32 or bf16 are supported)"),
    };
    let blocks = n.div_ceil(SUM_THREADS as usize).clamp(1, SUM_BLOCKS);
    let (n_u, blocks_i) = (n as u64, blocks as i32);
    // [blocks]; SAFETY: stage 1 writes one partial per block.
    let mut partial = unsafe { alloc::<f64>(dev, blocks) }?;
    // [1]; SAFETY: stage 2 writes the single result.
    let mut out = unsafe { alloc::<f64>(dev, 1) }?;
    let stream = dev.cuda_stream();
    let f = kernel(dev, &kernel_name(OP, "sum_squares_partial", elems)?)?;
    let mut builder = stream.launch_builder(&f);
    builder.arg(&xv).arg(&n_u).arg(&mut partial);
    // SAFETY: matches `sum_squares_partial_{f32,bf16}(const T*, u64, double*)`; reads elements
    // `i < n` of the buffer's `n` f32 or bf16 elements (its bytes), block `b < blocks` writes
    // partial[b].
    unsafe { builder.launch(grid(blocks, SUM_THREADS, 0)) }.w()?;
    let f = kernel(dev, "sum_squares_final")?;
    let mut builder = stream.launch_builder(&f);
    builder.arg(&partial).arg(&blocks_i).arg(&mut out);
    // SAFETY: matches `sum_squares_final(const double*, int, double*)`; one block reads
    // partial[0..blocks] and writes out[0].
    unsafe { builder.launch(grid(1, SUM_THREADS, 0)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
