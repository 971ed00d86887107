//! Launchers of the FP8 kernels of `kernels/fp8.cu` on contiguous f32, f64 or bf16 CUDA
//! storage: each block's amax (`fp8_amax`, into a zeroed word per block), then every element's
//! rounded value or code (`fp8_cast`) and the inverse scales (`fp8_inv_scales`). The scales stay
//! on the device: nothing is read back.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{
    CudaSlice, CudaView, DevicePtrMut, DeviceRepr, PushKernelArg,
};
use candle_core::cuda::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{bail, DType, Layout, Result};

use super::{alloc, elementwise, grid, kernel_name, load, view, zeros, Module};
use crate::ops::{Fp8Blocks, Fp8Format, Fp8Quant, Packing};

/// Threads per CUDA block of `fp8_amax` (`AMAX_THREADS` in the emulation driver).
const AMAX_THREADS: u32 = 256;

/// A scaling block of more than this many elements is shared by several CUDA blocks of
/// `fp8_amax` (`SPLIT_ELEMS` in the emulation driver), at most [`MAX_SPLITS`].
const SPLIT_ELEMS: usize = 4096;
const MAX_SPLITS: usize = 1024;

/// Each `br × bc` block's largest magnitude of `x` `[rows, cols]` (f32 bits, one word per
/// block): `fp8_amax` over `ceil(block elements / SPLIT_ELEMS)` CUDA blocks per block.
fn block_amax<T: DeviceRepr>(
    dev: &CudaDevice,
    op: &str,
    (xv, dtype): (&CudaView<'_, T>, DType),
    (rows, cols): (usize, usize),
    (br, bc): (usize, usize),
) -> Result<CudaSlice<u32>> {
    let blocks = rows.div_ceil(br) * cols.div_ceil(bc);
    let splits = (br * bc).div_ceil(SPLIT_ELEMS).clamp(1, MAX_SPLITS);
    if blocks.saturating_mul(splits) > i32::MAX as usize {
        bail!("{op}: {rows} x {cols} elements in {br} x {bc} blocks need too many CUDA blocks")
    }
    let mut amax = zeros::<u32>(dev, blocks)?; // [blocks], f32 bits
    let f = load(dev, Module::Fp8, &kernel_name(op, "fp8_amax", dtype)?)?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    let (rows_u, cols_u, br_u, bc_u) = (rows as u64, cols as u64, br as u64, bc as u64);
    let splits_u = splits as u32;
    b.arg(xv)
        .arg(&mut amax)
        .arg(&rows_u)
        .arg(&cols_u)
        .arg(&br_u)
        .arg(&bc_u);
    b.arg(&splits_u);
    // SAFETY: matches `fp8_amax_<T>(const T*, unsigned*, u64 x4, unsigned)`; CUDA block k reads
    // elements of scaling block k / splits < blocks only, and `amax` holds one word per block.
    unsafe { b.launch(grid(blocks * splits, AMAX_THREADS, 0)) }.w()?;
    Ok(amax)
}

/// `x` (`(rows, cols)` of its layout) rounded to FP8 as `q` says, in `x`'s dtype
/// (`ops::fp8_round`).
pub fn fp8_round(
    x: &CudaStorage,
    xl: &Layout,
    (rows, cols): (usize, usize),
    q: Fp8Quant,
) -> Result<CudaStorage> {
    const OP: &str = "fp8_round";
    let dev = x.device();
    let n = rows * cols;
    let (br, bc) = q.blocks.dims(rows, cols);
    let (rows_u, cols_u, br_u, bc_u) = (rows as u64, cols as u64, br as u64, bc as u64);
    let fmt = q.format.code();
    crate::with_cuda_dtype!(OP, x.dtype(), T => {
        let xv = view::<T>(OP, "x", x, xl)?; // [rows, cols]
        // SAFETY: fp8_cast writes every one of the n elements.
        let mut y = unsafe { alloc::<T>(dev, n) }?; // [rows, cols]
        if n > 0 {
            let amax = block_amax(dev, OP, (&xv, x.dtype()), (rows, cols), (br, bc))?;
            let stream = dev.cuda_stream();
            let dtype = x.dtype();
            let f = load(dev, Module::Fp8, &kernel_name(OP, "fp8_cast", dtype)?)?;
            let null = 0u64; // no codes: only the values are written
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&amax).arg(&null).arg(&null).arg(&mut y);
            b.arg(&rows_u).arg(&cols_u).arg(&br_u).arg(&bc_u).arg(&fmt);
            // SAFETY: matches `fp8_cast_<T>(const T*, const unsigned*, unsigned char*,
            // unsigned char*, T*, u64 x4, int)`; the grid-stride loop touches elements below
            // n = rows × cols.
            unsafe { b.launch(elementwise(n)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })
}

/// `x` (`(rows, cols)` of its layout) as E4M3 or E5M2 codes with one tensorwise scale, packed
/// as `packing` says (`ops::Packing`): the codes `[rows, cols]` and/or transposed `[cols, rows]`,
/// from one amax pass and one cast pass, then the scale's inverse (one f32), the factor an FP8
/// GEMM multiplies their product by.
pub fn quantize(
    x: &CudaStorage,
    xl: &Layout,
    (rows, cols): (usize, usize),
    format: Fp8Format,
    packing: Packing,
) -> Result<CudaStorage> {
    let dev = x.device();
    let packed = quantize_slice(x, xl, (rows, cols), format, packing)?;
    Ok(CudaStorage::wrap_cuda_slice(packed, dev.clone()))
}

/// [`quantize`] into a bare device buffer of `packing.len` bytes.
pub fn quantize_slice(
    x: &CudaStorage,
    xl: &Layout,
    (rows, cols): (usize, usize),
    format: Fp8Format,
    packing: Packing,
) -> Result<CudaSlice<u8>> {
    const OP: &str = "fp8_quantize";
    let dev = x.device();
    let n = rows * cols;
    let (br, bc) = Fp8Blocks::Tensor.dims(rows, cols);
    let (rows_u, cols_u, br_u, bc_u) = (rows as u64, cols as u64, br as u64, bc as u64);
    let (fmt, one) = (format.code(), 1u64);
    if xl.shape().elem_count() != n {
        bail!(
            "{OP}: x has {} elements, not {rows} x {cols}",
            xl.shape().elem_count()
        )
    }
    if packing != Packing::new(n, packing.plain.is_some(), packing.transposed.is_some()) {
        bail!("{OP}: {packing:?} does not pack {rows} x {cols} codes")
    }
    crate::with_cuda_dtype!(OP, x.dtype(), T => {
        let xv = view::<T>(OP, "x", x, xl)?; // [rows, cols]
        // SAFETY: fp8_cast writes every code of each part asked for, fp8_inv_scales the scale;
        // the alignment padding is never read.
        let mut packed = unsafe { alloc::<u8>(dev, packing.len) }?;
        let amax = block_amax(dev, OP, (&xv, x.dtype()), (rows, cols), (br, bc))?;
        let stream = dev.cuda_stream();
        let (base, guard) = packed.device_ptr_mut(&stream);
        let at = |part: Option<usize>| part.map_or(0u64, |o| base + o as u64); // 0: not written
        let (plain, transposed, scale) =
            (at(packing.plain), at(packing.transposed), base + packing.scale as u64);
        let dtype = x.dtype();
        if n > 0 {
            let f = load(dev, Module::Fp8, &kernel_name(OP, "fp8_cast", dtype)?)?;
            let null = 0u64;
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&amax).arg(&plain).arg(&transposed).arg(&null);
            b.arg(&rows_u).arg(&cols_u).arg(&br_u).arg(&bc_u).arg(&fmt);
            // SAFETY: matches `fp8_cast_<T>`; each part asked for holds n bytes of `packed`.
            unsafe { b.launch(elementwise(n)) }.w()?;
        }
        let f = load(dev, Module::Fp8, "fp8_inv_scales")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&amax).arg(&scale).arg(&one).arg(&fmt);
        // SAFETY: matches `fp8_inv_scales(const unsigned*, float*, u64, int)` for one block,
        // written at the packing's 256-byte aligned scale offset.
        unsafe { b.launch(elementwise(1)) }.w()?;
        drop(guard);
        Ok(packed)
    })
}
