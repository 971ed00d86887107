//! Launchers of the RMSNorm kernels of `kernels/pointwise.cu`: the forward, the forward fused
//! with the residual addition, and the backward (with or without the residual stream's gradient
//! added to `dx`), on contiguous f32, f64 or bf16 CUDA storage. One block of
//! [`ROW_THREADS`] threads per row (the backward: per run of rows), sums in a fixed order.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::PushKernelArg;
use candle_core::cuda::{CudaStorage, WrapErr};
use candle_core::{bail, Layout, Result};

use super::pointwise::{check_len, kernel, ROW_THREADS};
use super::{alloc, grid, to_i32, view, KernelFloat};

/// At most this many blocks (each a run of rows) produce `dweight` partials in the RMSNorm
/// backward; the partial buffer is `[blocks, h]` in the accumulation type.
const RMS_DW_BLOCKS: usize = 1024;

/// Columns per block and threads per block of `rms_norm_dw` (`DW_COLS`, `DW_THREADS` in
/// `kernels/pointwise.cu`).
const DW_COLS: usize = 32;
const DW_THREADS: u32 = 256;

/// `x`'s elements and `weight`'s `h`, once `x` is checked to be made of rows of `h`.
fn rows_of(op: &str, xl: &Layout, wl: &Layout) -> Result<(usize, usize)> {
    let (nx, h) = (xl.shape().elem_count(), wl.shape().elem_count());
    if h == 0 || nx % h != 0 {
        bail!("{op}: `x` ({nx} elements) is not made of rows of `weight` ({h} elements)")
    }
    Ok((nx, h))
}

/// RMSNorm forward: `x` `[rows, h]` (any leading shape), `w` `[h]`; returns `y` like `x`.
pub fn rms_norm_fwd(
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    eps: f64,
) -> Result<CudaStorage> {
    const OP: &str = "rms_norm";
    let dev = x.device();
    let (nx, h) = rows_of(OP, xl, wl)?;
    let rows = nx / h;
    let (rows_i, h_i) = (to_i32(OP, "rows", rows)?, to_i32(OP, "h", h)?);
    crate::with_cuda_dtype!(OP, x.dtype(), T => {
        let xv = view::<T>(OP, "x", x, xl)?; // [rows, h]
        let wv = view::<T>(OP, "weight", w, wl)?; // [h]
        // SAFETY: block `r` writes every element of row `r`, for all `rows` rows.
        let mut y = unsafe { alloc::<T>(dev, nx) }?; // [rows, h]
        if rows > 0 {
            let f = kernel(dev, OP, "rms_norm_fwd", x.dtype())?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&wv).arg(&mut y).arg(&rows_i).arg(&h_i).arg(&eps);
            // SAFETY: matches `rms_norm_fwd_<T>(const T*, const T*, T*, int, int, double)`;
            // `x` and `y` hold rows × h elements, `w` h, and block `r < rows` touches row `r`.
            unsafe { b.launch(grid(rows, ROW_THREADS, 0)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })
}

/// The residual addition and RMSNorm in one pass: `x`, `o` `[rows, h]`, `w` `[h]`; returns
/// `s = x + o` and `y = rms_norm(s)`, each `[rows, h]` in storage of its own.
pub fn add_rms_norm_fwd(
    (x, xl): (&CudaStorage, &Layout),
    (o, ol): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
    eps: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "add_rms_norm";
    let dev = x.device();
    let (nx, h) = rows_of(OP, xl, wl)?;
    check_len(OP, "o", ol.shape().elem_count(), nx)?;
    let rows = nx / h;
    let (rows_i, h_i) = (to_i32(OP, "rows", rows)?, to_i32(OP, "h", h)?);
    crate::with_cuda_dtype!(OP, x.dtype(), T => {
        let xv = view::<T>(OP, "x", x, xl)?; // [rows, h]
        let ov = view::<T>(OP, "o", o, ol)?; // [rows, h]
        let wv = view::<T>(OP, "weight", w, wl)?; // [h]
        // SAFETY: block `r` writes every element of row `r` of both, for all rows.
        let mut s = unsafe { alloc::<T>(dev, nx) }?; // [rows, h]
        let mut y = unsafe { alloc::<T>(dev, nx) }?; // [rows, h]
        if rows > 0 {
            let f = kernel(dev, OP, "add_rms_norm_fwd", x.dtype())?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&ov).arg(&wv).arg(&mut s).arg(&mut y);
            b.arg(&rows_i).arg(&h_i).arg(&eps);
            // SAFETY: matches `add_rms_norm_fwd_<T>(const T*, const T*, const T*, T*, T*, int,
            // int, double)`; `x`, `o`, `s` and `y` hold rows × h elements, `w` h, and block
            // `r < rows` touches row `r` of each.
            unsafe { b.launch(grid(rows, ROW_THREADS, 0)) }.w()?;
        }
        let wrap = |t| CudaStorage::wrap_cuda_slice(t, dev.clone());
        Ok((wrap(s), wrap(y)))
    })
}

/// RMSNorm backward on `(x [rows, h], w [h], grad [rows, h])`: returns the flat
/// `[rows * h + h]` concatenation of `dx` and `dweight`, like the CPU `RmsNormBwd`; with a
/// `residual` gradient `[rows, h]`, `dx` is added to it as it is written.
/// `dweight` is summed deterministically: runs of rows write partials, then a second kernel
/// sums the partials in run order.
pub fn rms_norm_bwd(
    (x, xl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
    (g, gl): (&CudaStorage, &Layout),
    residual: Option<(&CudaStorage, &Layout)>,
    eps: f64,
) -> Result<CudaStorage> {
    const OP: &str = "rms_norm";
    let dev = x.device();
    let (nx, h) = rows_of(OP, xl, wl)?;
    check_len(OP, "grad", gl.shape().elem_count(), nx)?;
    if let Some((_, rl)) = residual {
        check_len(OP, "residual", rl.shape().elem_count(), nx)?;
    }
    let rows = nx / h;
    let rows_per_block = rows.div_ceil(RMS_DW_BLOCKS).max(1);
    let blocks = rows.div_ceil(rows_per_block);
    let (rows_i, h_i) = (to_i32(OP, "rows", rows)?, to_i32(OP, "h", h)?);
    let (rpb_i, blocks_i) = (
        to_i32(OP, "rows", rows_per_block)?,
        to_i32(OP, "rows", blocks)?,
    );
    crate::with_cuda_dtype!(OP, x.dtype(), T => {
        let xv = view::<T>(OP, "x", x, xl)?; // [rows, h]
        let wv = view::<T>(OP, "weight", w, wl)?; // [h]
        let gv = view::<T>(OP, "grad", g, gl)?; // [rows, h]
        // SAFETY: stage 1 writes dx (the first rows × h elements), stage 2 dweight (the last h).
        let mut out = unsafe { alloc::<T>(dev, nx + h) }?; // [rows * h + h]
        // SAFETY: block `b < blocks` zeroes, then accumulates, its partial row `b`.
        let mut partial = unsafe { alloc::<<T as KernelFloat>::Acc>(dev, blocks * h) }?; // [blocks, h]
        let stream = dev.cuda_stream();
        let rv = match residual {
            Some((r, rl)) => Some(view::<T>(OP, "residual", r, rl)?), // [rows, h]
            None => None,
        };
        if rows > 0 {
            let base = if rv.is_some() { "rms_norm_bwd_add" } else { "rms_norm_bwd" };
            let f = kernel(dev, OP, base, x.dtype())?;
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&wv).arg(&gv);
            if let Some(rv) = &rv {
                b.arg(rv);
            }
            b.arg(&mut out).arg(&mut partial);
            b.arg(&rows_i).arg(&h_i).arg(&rpb_i).arg(&eps);
            // SAFETY: matches `rms_norm_bwd_<T>(const T*, const T*, const T*, T*, Acc*, int,
            // int, int, double)` and, with the residual, `rms_norm_bwd_add_<T>(const T*, const
            // T*, const T*, const T*, T*, Acc*, int, int, int, double)`; block `b < blocks`
            // touches rows [b rpb, min((b + 1) rpb, rows)) of x, grad, the residual and out
            // (rows × h each) and row `b` of `partial` ([blocks, h]).
            unsafe { b.launch(grid(blocks, ROW_THREADS, 0)) }.w()?;
        }
        let mut dw = out.slice_mut(nx..); // [h]
        let f = kernel(dev, OP, "rms_norm_dw", x.dtype())?;
        let mut b = stream.launch_builder(&f);
        b.arg(&partial).arg(&mut dw).arg(&blocks_i).arg(&h_i);
        // SAFETY: matches `rms_norm_dw_<T>(const Acc*, T*, int, int)`; block `c` of
        // ⌈h / 32⌉ (DW_THREADS = 256 threads, as the kernel requires) reads columns
        // 32c..32c+32 (< h) of the `[blocks, h]` partials (all written by stage 1) and writes
        // those of `dw`.
        unsafe { b.launch(grid(h.div_ceil(DW_COLS), DW_THREADS, 0)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })
}
