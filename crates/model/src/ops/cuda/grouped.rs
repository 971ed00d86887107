//! Grouped linears on CUDA (`ops::grouped_linear`): every non-empty run of rows and its weight
//! as one group of `cublasGemmGroupedBatchedEx`, f32 accumulation, on the device stream's
//! cuBLAS handle. The per-group sizes are host arrays; the operands' addresses go to the
//! device in one small copy per call.

use std::ffi::{c_int, c_void};

use candle_core::cuda::cudarc::cublas::sys;
use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Result, Storage, Tensor};

use super::alloc;
use crate::ops::Grouped;

const OP: &str = "grouped linear";

fn to_int(v: usize) -> Result<c_int> {
    c_int::try_from(v)
        .map_err(|_| candle_core::Error::Msg(format!("{OP}: {v} exceeds cuBLAS's 32-bit sizes")))
}

/// The device address of contiguous CUDA tensor `t`'s first element (of type `T`), with its
/// storage read-locked for as long as the address is used.
fn address<'a, T: CudaDType + DeviceRepr>(
    t: &'a Tensor,
    dev: &CudaDevice,
) -> Result<(u64, impl std::ops::Deref<Target = Storage> + 'a)> {
    let (s, l) = t.storage_and_layout();
    let Some((start, _)) = l.contiguous_offsets() else {
        bail!("{OP}: operands must be contiguous")
    };
    let base = match &*s {
        Storage::Cuda(c) => c.as_cuda_slice::<T>()?.device_ptr(&dev.cuda_stream()).0,
        _ => bail!("{OP}: operands must be on one CUDA device"),
    };
    Ok((base + (start * std::mem::size_of::<T>()) as u64, s))
}

/// `kind`'s product for every run of rows of contiguous `x` `[m, ·]`; the result is `[m, width]`
/// (f32 or bf16).
pub fn grouped(
    x: &Tensor,
    counts: &[usize],
    ws: &[&Tensor],
    kind: Grouped,
    width: usize,
) -> Result<Tensor> {
    let candle_core::Device::Cuda(dev) = x.device() else {
        bail!("{OP}: not a CUDA tensor")
    };
    let storage = match x.dtype() {
        DType::F32 => typed::<f32>(
            dev,
            x,
            counts,
            ws,
            kind,
            width,
            sys::cudaDataType_t::CUDA_R_32F,
        )?,
        DType::BF16 => typed::<half::bf16>(
            dev,
            x,
            counts,
            ws,
            kind,
            width,
            sys::cudaDataType_t::CUDA_R_16BF,
        )?,
        d => bail!("{OP}: {d:?} on CUDA (f32 and bf16 are grouped)"),
    };
    let m = x.dim(0)?;
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        (m, width),
        BackpropOp::none(),
        false,
    ))
}

#[allow(clippy::too_many_arguments)]
fn typed<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    x: &Tensor,
    counts: &[usize],
    ws: &[&Tensor],
    kind: Grouped,
    width: usize,
    ty: sys::cudaDataType_t,
) -> Result<CudaStorage> {
    // Before any lock is held: which storage each weight views.
    let keys: Vec<usize> = ws.iter().map(|w| crate::segment::storage_key(w)).collect();
    let (m, xw) = x.dims2()?;
    let (out, inp) = ws[0].dims2()?;
    let size = std::mem::size_of::<T>() as u64;
    let stream = dev.cuda_stream();
    // SAFETY: the groups write every row of the output (the runs cover all m rows).
    let mut y = unsafe { alloc::<T>(dev, m * width) }?; // [m, width]
    let (y0, y_written) = y.device_ptr_mut(&stream);
    let (x0, x_read) = address::<T>(x, dev)?;
    // Per group, column-major (cuBLAS's view of the row-major buffers), run e of c rows:
    //   forward  yᵀ [out, c] = (w [in, out])ᵀ · x [in, c]: m = out, n = c, k = in, A transposed
    //   dx       dxᵀ [in, c] = w [in, out] · g [out, c]:   m = in,  n = c, k = out
    let (gm, gk, op_a) = match kind {
        Grouped::Forward => (out, inp, sys::cublasOperation_t::CUBLAS_OP_T),
        Grouped::InputGrad => (inp, out, sys::cublasOperation_t::CUBLAS_OP_N),
    };
    let (mut a, mut b, mut c, mut n) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // The weights' storages, read-locked once each: experts' weights packed in one parameter
    // tensor share a storage, whose lock one thread must not take twice.
    let mut held = Vec::with_capacity(ws.len());
    let mut bases: Vec<(usize, u64)> = Vec::new(); // (storage key, device address of element 0)
    let mut row = 0u64;
    for ((&rows, w), &key) in counts.iter().zip(ws).zip(&keys) {
        if rows > 0 {
            let start = w.layout().start_offset() as u64 * size;
            let w0 = match bases.iter().find(|(k, _)| *k == key) {
                Some(&(_, base)) => base + start,
                None => {
                    let (w0, lock) = address::<T>(w, dev)?;
                    held.push(lock);
                    bases.push((key, w0 - start));
                    w0
                }
            };
            a.push(w0);
            b.push(x0 + row * xw as u64 * size);
            c.push(y0 + row * width as u64 * size);
            n.push(to_int(rows)?);
        }
        row += rows as u64;
    }
    let groups = a.len();
    let same = |v: usize| -> Result<Vec<c_int>> { Ok(vec![to_int(v)?; groups]) };
    let (ms, ks, ldas, ldbs, ldcs) = (same(gm)?, same(gk)?, same(inp)?, same(xw)?, same(width)?);
    let ops_a = vec![op_a; groups];
    let ops_b = vec![sys::cublasOperation_t::CUBLAS_OP_N; groups];
    let (alpha, beta, sizes) = (
        vec![1f32; groups],
        vec![0f32; groups],
        vec![1 as c_int; groups],
    );
    let addrs = stream
        .clone_htod(&[a, b, c].concat())
        .map_err(|e| candle_core::Error::Msg(format!("{OP}: {e}")))?; // [3 × groups]
    let (arrays, arrays_read) = addrs.device_ptr(&stream);
    let word = std::mem::size_of::<u64>() as u64;
    let blas = dev.cublas_handle();
    // SAFETY: host arrays of `groups` entries; the device arrays hold `groups` addresses each,
    // of live buffers of the device's stream: weight e [out, in], run e of x [c, xw] and of y
    // [c, width], as the leading dimensions address them.
    let status = unsafe {
        sys::cublasGemmGroupedBatchedEx(
            *blas.handle(),
            ops_a.as_ptr(),
            ops_b.as_ptr(),
            ms.as_ptr(),
            n.as_ptr(),
            ks.as_ptr(),
            alpha.as_ptr() as *const c_void,
            arrays as *const *const c_void,
            ty,
            ldas.as_ptr(),
            (arrays + groups as u64 * word) as *const *const c_void,
            ty,
            ldbs.as_ptr(),
            beta.as_ptr() as *const c_void,
            (arrays + 2 * groups as u64 * word) as *const *mut c_void,
            ty,
            ldcs.as_ptr(),
            to_int(groups)?,
            sizes.as_ptr(),
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
    };
    if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        bail!("{OP}: cublasGemmGroupedBatchedEx failed ({status:?}) for runs of {counts:?} rows")
    }
    drop((held, x_read, y_written, arrays_read));
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}
