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
use crate::ops::{Fp8Format, Fp8Quant, Packing, Part};

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

/// `x` (`packing.rows × packing.cols` of its layout) as E4M3 or E5M2 codes packed as
/// `packing` says (`ops::Packing`): the codes `[rows, cols]` and/or transposed `[cols, rows]`,
/// each followed by the inverse scales of its blocks (the factors an FP8 GEMM multiplies by), in
/// the order its part names. Parts with the same blocks share one amax pass and one cast pass.
pub fn quantize(
    x: &CudaStorage,
    xl: &Layout,
    format: Fp8Format,
    packing: Packing,
) -> Result<CudaStorage> {
    const OP: &str = "fp8_quantize";
    let dev = x.device();
    let (rows, cols) = (packing.rows, packing.cols);
    let n = rows * cols;
    if xl.shape().elem_count() != n {
        bail!(
            "{OP}: x has {} elements, not {rows} x {cols}",
            xl.shape().elem_count()
        )
    }
    let blocks = |p: Option<Part>| p.map(|p| p.blocks);
    if packing
        != Packing::new(
            (rows, cols),
            blocks(packing.plain),
            blocks(packing.transposed),
        )
    {
        bail!("{OP}: {packing:?} is not a packing of {rows} x {cols} codes")
    }
    // The passes: the parts that share their blocks together.
    let passes: Vec<Vec<Part>> = match (packing.plain, packing.transposed) {
        (Some(a), Some(b)) if a.blocks == b.blocks => vec![vec![a, b]],
        (a, b) => a.into_iter().chain(b).map(|p| vec![p]).collect(),
    };
    let (rows_u, cols_u, fmt) = (rows as u64, cols as u64, format.code());
    crate::with_cuda_dtype!(OP, x.dtype(), T => {
        let xv = view::<T>(OP, "x", x, xl)?; // [rows, cols]
        // SAFETY: fp8_cast writes every code of each part, fp8_inv_scales each part's scales;
        // the alignment padding is never read.
        let mut packed = unsafe { alloc::<u8>(dev, packing.len) }?;
        let stream = dev.cuda_stream();
        let dtype = x.dtype();
        for parts in &passes {
            let (br, bc) = parts[0].blocks.dims(rows, cols);
            let (nbr, nbc) = packing.grid(&parts[0]);
            let (nbr, nbc) = (nbr as u64, nbc as u64);
            let amax = block_amax(dev, OP, (&xv, dtype), (rows, cols), (br, bc))?;
            let (base, guard) = packed.device_ptr_mut(&stream);
            let codes = |transposed: bool| {
                let p = parts.iter().find(|p| p.transposed == transposed);
                p.map_or(0u64, |p| base + p.codes as u64) // 0: not written
            };
            let (plain, transposed) = (codes(false), codes(true));
            if n > 0 {
                let f = load(dev, Module::Fp8, &kernel_name(OP, "fp8_cast", dtype)?)?;
                let (null, br_u, bc_u) = (0u64, br as u64, bc as u64);
                let mut b = stream.launch_builder(&f);
                b.arg(&xv).arg(&amax).arg(&plain).arg(&transposed).arg(&null);
                b.arg(&rows_u).arg(&cols_u).arg(&br_u).arg(&bc_u).arg(&fmt);
                // SAFETY: matches `fp8_cast_<T>`; each part written holds n bytes of `packed`.
                unsafe { b.launch(elementwise(n)) }.w()?;
            }
            for p in parts {
                let f = load(dev, Module::Fp8, "fp8_inv_scales")?;
                let (scales, colmajor) = (base + p.scales as u64, p.colmajor() as i32);
                let ld = p.ld as u64; // 1 for one tensor scale
                let mut b = stream.launch_builder(&f);
                b.arg(&amax).arg(&scales).arg(&nbr).arg(&nbc).arg(&colmajor).arg(&ld).arg(&fmt);
                // SAFETY: matches `fp8_inv_scales(const unsigned*, float*, u64, u64, int, u64,
                // int)`; the part's scales hold lines · ld floats at a 256-byte aligned offset.
                unsafe { b.launch(elementwise(p.lines * p.ld)) }.w()?;
            }
            drop(guard);
        }
        Ok(CudaStorage::wrap_cuda_slice(packed, dev.clone()))
    })
}
