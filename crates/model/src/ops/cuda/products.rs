//! The optimizer's cuBLAS products, called from the root crate's `optim::kernels` and Muon: a
//! weight gradient `gᵀ · x` accumulated into its f32 buffer slot (beta = 1, or 0 for a step's
//! first gradient; `g` may be a range
//! of a wider gradient's columns, read in place), and Muon's scaled products, rounded as
//! `torch.addmm` rounds them, one or a batch at a time.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cublas::sys::cudaDataType_t;
use candle_core::cuda::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{bail, DType, Layout, Result};

use super::flat::{f32_slot, range, slot_range};
use super::view;

/// `dst[out, in] = beta · dst + gᵀ · x` (row-major) for an f32 buffer view `dst`, `g`
/// `[rows, out]` and `x` `[rows, in]`, both f32 or both bf16: one `cublasGemmEx` with f32
/// accumulation and output on the device's stream (whose handle candle made for it); beta 1
/// accumulates, beta 0 writes the product over the old values without reading them.
pub fn add_product(
    dst: &mut CudaStorage,
    dl: &Layout,
    (g, gl): (&CudaStorage, &Layout),
    (x, xl): (&CudaStorage, &Layout),
    (rows, out, inp, beta): (usize, usize, usize, f32),
) -> Result<()> {
    const OP: &str = "add-product";
    let dev = dst.device().clone();
    let (a, b) = slot_range(OP, dl, (out, inp))?;
    if out * inp == 0 {
        return Ok(());
    }
    if rows == 0 {
        // An empty sum: the buffer is kept, or written with zeros.
        if beta == 0.0 {
            let mut d = f32_slot(OP, dst, (a, b))?;
            dev.cuda_stream().memset_zeros(&mut d).w()?;
        }
        return Ok(());
    }
    if g.dtype() != x.dtype() {
        bail!("{OP}: g is {:?} but x is {:?}", g.dtype(), x.dtype())
    }
    let dims = [rows, out, inp].map(i32::try_from);
    let [Ok(rows), Ok(out), Ok(inp)] = dims else {
        bail!("{OP}: [{rows}, {out}] x [{rows}, {inp}] exceeds cuBLAS's 32-bit dimensions")
    };
    let mut d = f32_slot(OP, dst, (a, b))?; // [out, in]
    match g.dtype() {
        candle_core::DType::F32 => gemm_ex::<f32>(
            &dev,
            &mut d,
            (g, gl),
            (x, xl),
            cudaDataType_t::CUDA_R_32F,
            (rows, out, inp, beta),
        ),
        candle_core::DType::BF16 => gemm_ex::<half::bf16>(
            &dev,
            &mut d,
            (g, gl),
            (x, xl),
            cudaDataType_t::CUDA_R_16BF,
            (rows, out, inp, beta),
        ),
        other => bail!("{OP}: no fused product for {other:?} factors"),
    }
}

/// [`add_product`] for factors of element type `T` (cuBLAS type `ty`).
fn gemm_ex<T: candle_core::cuda::CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    d: &mut candle_core::cuda::cudarc::driver::CudaViewMut<'_, f32>,
    (g, gl): (&CudaStorage, &Layout),
    (x, xl): (&CudaStorage, &Layout),
    ty: cudaDataType_t,
    (rows, out, inp, beta): (i32, i32, i32, f32),
) -> Result<()> {
    use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut};
    const OP: &str = "add-product";
    let (gv, ld) = rows_view::<T>(OP, (g, gl), (rows, out))?; // [rows, out], rows `ld` apart
    let xv = view::<T>(OP, "x", x, xl)?; // [rows, in]
    let stream = dev.cuda_stream();
    let (gp, _g_read) = gv.device_ptr(&stream);
    let (xp, _x_read) = xv.device_ptr(&stream);
    let (dp, _d_write) = d.device_ptr_mut(&stream);
    // Column-major, cuBLAS's view of the row-major buffers: D'[in, out] (ld in) = beta D' +
    // X'[in, rows] (ld in) · G'[out, rows]ᵀ (ld ld), i.e. D[o, i] = beta D[o, i] +
    // Σ_r g[r, o] · x[r, i].
    let call = GemmCall {
        transpose_b: true,
        mnk: (inp, out, rows),
        a: (xp, inp),
        b: (gp, ld),
        d: (dp, inp),
        types: (ty, cudaDataType_t::CUDA_R_32F),
        scale: (1.0, beta),
        batch: (1, [0; 3]),
    };
    // SAFETY: the pointers are live device buffers of the device's stream holding rows·in,
    // rows·out and out·in elements, as the leading dimensions address them.
    unsafe { gemm_call(dev, OP, call) }
}

/// A `[rows, cols]` matrix whose rows may lie `ld ≥ cols` elements apart (a range of a wider
/// matrix's columns, `super::super::row_strided`), from its first element to its last, and `ld`.
fn rows_view<
    'a,
    T: candle_core::cuda::CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr,
>(
    op: &str,
    (s, l): (&'a CudaStorage, &Layout),
    (rows, cols): (i32, i32),
) -> Result<(candle_core::cuda::cudarc::driver::CudaView<'a, T>, i32)> {
    let (rows, cols) = (rows as usize, cols as usize);
    let Some((range, ld)) = super::super::row_strided(l).filter(|_| l.dims() == [rows, cols])
    else {
        bail!("{op}: g must be [{rows}, {cols}] with rows of unit stride, got {l:?}")
    };
    let Ok(ld32) = i32::try_from(ld) else {
        bail!("{op}: g's rows lie {ld} elements apart, past cuBLAS's 32-bit leading dimension")
    };
    let data = match s.as_cuda_slice::<T>() {
        Ok(d) => d,
        Err(_) => bail!("{op}: g has dtype {:?}", s.dtype()),
    };
    if range.end > data.len() {
        bail!("{op}: g's rows reach past its buffer ({l:?})")
    }
    Ok((data.slice(range), ld32))
}

/// `d ← beta · d + alpha · a · b` (row-major) for `d` `[m, n]`, `a` `[m, k]` and `b` `[k, n]`,
/// or `batch` of them back to back, all contiguous and all f32 or all bf16: one `cublasGemmEx`
/// (a batch: one `cublasGemmStridedBatchedEx`) with f32 accumulation and f32 scalars, so `d` is
/// rounded once (as `torch.addmm` computes it; Muon's Newton-Schulz steps).
pub fn scaled_product(
    d: &mut CudaStorage,
    dl: &Layout,
    (a, al): (&CudaStorage, &Layout),
    (b, bl): (&CudaStorage, &Layout),
    (batch, (m, k, n)): (usize, (usize, usize, usize)),
    (alpha, beta): (f32, f32),
) -> Result<()> {
    const OP: &str = "scaled-product";
    let dev = d.device().clone();
    let (start, end) = range(OP, "output", dl)?;
    if end - start != batch * m * n {
        bail!(
            "{OP}: output of {} elements for {batch} × [{m}, {n}]",
            end - start
        )
    }
    if batch * m * n == 0 {
        return Ok(());
    }
    let dims = [m, k, n, batch].map(i32::try_from);
    let [Ok(mi), Ok(ki), Ok(ni), Ok(bi)] = dims else {
        bail!("{OP}: {batch} × [{m}, {k}] x [{k}, {n}] exceeds cuBLAS's 32-bit dimensions")
    };
    let dtype = d.dtype();
    if a.dtype() != dtype || b.dtype() != dtype {
        bail!(
            "{OP}: factors {:?} and {:?} for a {dtype:?} output",
            a.dtype(),
            b.dtype()
        )
    }
    macro_rules! typed {
        ($T:ty, $ty:expr) => {{
            use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut};
            let av = view::<$T>(OP, "a", a, al)?; // [B, m, k]
            let bv = view::<$T>(OP, "b", b, bl)?; // [B, k, n]
            if av.len() != batch * m * k || bv.len() != batch * k * n {
                bail!(
                    "{OP}: factors of {} and {} elements for {batch} × [{m}, {k}] x [{k}, {n}]",
                    av.len(),
                    bv.len()
                )
            }
            let data = d.as_cuda_slice_mut::<$T>()?;
            let mut dv = data.slice_mut(start..end); // [m, n]
            let stream = dev.cuda_stream();
            let (ap, _a_read) = av.device_ptr(&stream);
            let (bp, _b_read) = bv.device_ptr(&stream);
            let (dp, _d_write) = dv.device_ptr_mut(&stream);
            // Column-major: D'[n, m] (ld n) = B'[n, k] (ld n) · A'[k, m] (ld k).
            let call = GemmCall {
                transpose_b: false,
                mnk: (ni, mi, ki),
                a: (bp, ni),
                b: (ap, ki),
                d: (dp, ni),
                types: ($ty, $ty),
                scale: (alpha, beta),
                batch: (bi, [k * n, m * k, m * n].map(|s| s as i64)),
            };
            // SAFETY: live device buffers of the device's stream of B·k·n, B·m·k and B·m·n
            // elements (checked above), as the leading dimensions and strides address them;
            // `d` overlaps neither.
            unsafe { gemm_call(&dev, OP, call) }
        }};
    }
    match dtype {
        DType::F32 => typed!(f32, cudaDataType_t::CUDA_R_32F),
        DType::BF16 => typed!(half::bf16, cudaDataType_t::CUDA_R_16BF),
        other => bail!("{OP}: no product for {other:?} (f32 or bf16)"),
    }
}

/// One `cublasGemmEx` in cuBLAS's column-major view: `D[m, n] ← alpha · A[m, k] · op(B) + beta
/// · D`, `op(B)` = `B[k, n]` or `B[n, k]ᵀ`; pointers with their leading dimensions, the
/// factors' and the output's types, f32 accumulation and host f32 scalars; with a batch of more
/// than one, `cublasGemmStridedBatchedEx` with the strides of `A`, `B` and `D`.
struct GemmCall {
    transpose_b: bool,
    mnk: (i32, i32, i32),
    a: (u64, i32),
    b: (u64, i32),
    d: (u64, i32),
    types: (cudaDataType_t, cudaDataType_t),
    scale: (f32, f32),
    batch: (i32, [i64; 3]),
}

/// Runs `call` on the device's stream with the cuBLAS handle candle made for it.
///
/// # Safety
/// The pointers must be live device buffers of the device's stream, large enough for the
/// dimensions and leading dimensions of `call`, `d` overlapping neither factor.
unsafe fn gemm_call(dev: &CudaDevice, op: &str, call: GemmCall) -> Result<()> {
    use candle_core::cuda::cudarc::cublas::{result, sys};
    let GemmCall {
        transpose_b,
        mnk: (m, n, k),
        a,
        b,
        d,
        types,
        scale: (alpha, beta),
        batch: (count, [stride_a, stride_b, stride_d]),
    } = call;
    let op_b = if transpose_b {
        sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        sys::cublasOperation_t::CUBLAS_OP_N
    };
    let blas = dev.cublas_handle();
    if count > 1 {
        // SAFETY: as below, for `count` products `stride_*` elements apart.
        return unsafe {
            result::gemm_strided_batched_ex(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_N,
                op_b,
                m,
                n,
                k,
                (&alpha as *const f32).cast(),
                a.0 as *const std::ffi::c_void,
                types.0,
                a.1,
                stride_a,
                b.0 as *const std::ffi::c_void,
                types.0,
                b.1,
                stride_b,
                (&beta as *const f32).cast(),
                d.0 as *mut std::ffi::c_void,
                types.1,
                d.1,
                stride_d,
                count,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| candle_core::Error::Msg(format!("{op}: cublasGemmStridedBatchedEx: {e:?}")));
    }
    // SAFETY: forwarded to the caller; alpha and beta are host scalars (the handle's default
    // pointer mode) read before the call returns.
    unsafe {
        result::gemm_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_N,
            op_b,
            m,
            n,
            k,
            (&alpha as *const f32).cast(),
            a.0 as *const std::ffi::c_void,
            types.0,
            a.1,
            b.0 as *const std::ffi::c_void,
            types.0,
            b.1,
            (&beta as *const f32).cast(),
            d.0 as *mut std::ffi::c_void,
            types.1,
            d.1,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| candle_core::Error::Msg(format!("{op}: cublasGemmEx: {e:?}")))
}
