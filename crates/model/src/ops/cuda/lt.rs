//! FP8 GEMMs through cuBLASLt: a linear's forward, input gradient and weight gradient on
//! operands already quantized (`ops::Fp8Operand`: codes packed with their inverse scales, as laid
//! out or transposed as the plan of `ops::fp8::gemm` says, made once for every GEMM that reads
//! them); each one `cublasLtMatmul` with the scales as `A_SCALE_POINTER` / `B_SCALE_POINTER`
//! and, for blockwise scaling, their modes (`VEC128_32F`, `BLK128x128_32F`; Hopper). One handle and 32 MiB workspace per
//! CUDA context; the algorithm the heuristic picks for a plan is kept, so a shape is searched
//! once and always runs the same kernel.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, LazyLock, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda::cudarc::driver::sys::CUdeviceptr;
use candle_core::cuda::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use candle_core::cuda::{CudaDevice, CudaStorage};
use candle_core::{bail, Layout, Result};

use super::alloc;
use crate::ops::{Fp8Format, LtGemm, LtMatrix, LtOut, LtScale, Packing};

/// Workspace bytes of a handle (NVIDIA's recommendation for Hopper).
const WORKSPACE: usize = 32 << 20;

fn lt_err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt {what}: {e:?}"))
}

/// A stream's handle, workspace and the algorithms chosen so far, by plan and the alignment of
/// D (at least 16 bytes: [`add_product`] goes through an aligned temporary otherwise).
struct Handle {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    algos: Mutex<HashMap<(LtGemm, u32), sys::cublasLtMatmulAlgo_t>>,
}

// SAFETY: the handle is used on its context's one stream, and cuBLASLt handles may be shared
// between host threads.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

/// The handle of `dev`'s stream (one per stream: its workspace is used by that stream's calls
/// only).
fn handle(dev: &CudaDevice) -> Result<Arc<Handle>> {
    static HANDLES: LazyLock<Mutex<HashMap<usize, Arc<Handle>>>> = LazyLock::new(Mutex::default);
    let key = dev.cuda_stream().cu_stream() as usize;
    let mut all = HANDLES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(h) = all.get(&key) {
        return Ok(h.clone());
    }
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().map_err(|e| lt_err("context", e))?;
    let h = Arc::new(Handle {
        handle: lt::create_handle().map_err(|e| lt_err("handle", e))?,
        // SAFETY: the workspace is cuBLASLt's scratch; nothing reads it before it writes.
        workspace: unsafe { alloc::<u8>(dev, WORKSPACE) }?,
        algos: Mutex::default(),
    });
    all.insert(key, h.clone());
    Ok(h)
}

fn data_type(f: Fp8Format) -> sys::cudaDataType {
    match f {
        Fp8Format::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
        Fp8Format::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
    }
}

/// cuBLASLt's scale mode of an operand (Hopper's block scaling: CUDA 12.9 and newer).
fn scale_mode(s: LtScale) -> sys::cublasLtMatmulMatrixScale_t {
    use sys::cublasLtMatmulMatrixScale_t as M;
    match s {
        LtScale::Scalar => M::CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F,
        LtScale::Vec128 => M::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
        LtScale::Blk128 => M::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
    }
}

/// Descriptors of one call, destroyed when dropped.
struct Descs {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: created by this value, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in &self.layouts {
                let _ = lt::destroy_matrix_layout(*l);
            }
        }
    }
}

fn layout(ty: sys::cudaDataType, m: &LtMatrix) -> Result<sys::cublasLtMatrixLayout_t> {
    lt::create_matrix_layout(ty, m.rows, m.cols, m.ld as i64).map_err(|e| lt_err("layout", e))
}

/// # Safety
/// `value` must point to a value of the attribute's type, `size` bytes long.
unsafe fn set(
    d: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: *const c_void,
    size: usize,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    unsafe { lt::set_matmul_desc_attribute(d, attr, value, size) }
        .map_err(|e| lt_err("descriptor", e))
}

/// Runs `plan` on FP8 codes `a` and `b` with inverse scales `a_inv`, `b_inv` (one f32 each)
/// into `d` (bf16 or f32 as the plan says).
///
/// # Safety
/// The pointers must be live device buffers of `dev`'s stream holding what the plan's
/// matrices address, and stay alive until the stream has run the call.
unsafe fn matmul(
    dev: &CudaDevice,
    plan: &LtGemm,
    (a, b): (CUdeviceptr, CUdeviceptr),
    (a_inv, b_inv): (CUdeviceptr, CUdeviceptr),
    d: CUdeviceptr,
) -> Result<()> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    let h = handle(dev)?;
    let desc = lt::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType::CUDA_R_32F,
    )
    .map_err(|e| lt_err("descriptor", e))?;
    let mut descs = Descs {
        desc,
        layouts: Vec::new(),
    };
    let (t, n, fast) = (1i32, 0i32, plan.fast_accum as i8); // CUBLAS_OP_T, CUBLAS_OP_N
    let int = std::mem::size_of::<i32>();
    let ptr = std::mem::size_of::<CUdeviceptr>();
    // SAFETY: each value has its attribute's type and size.
    unsafe {
        set(
            desc,
            A::CUBLASLT_MATMUL_DESC_TRANSA,
            &t as *const i32 as _,
            int,
        )?;
        set(
            desc,
            A::CUBLASLT_MATMUL_DESC_TRANSB,
            &n as *const i32 as _,
            int,
        )?;
        set(
            desc,
            A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
            &a_inv as *const _ as _,
            ptr,
        )?;
        set(
            desc,
            A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            &b_inv as *const _ as _,
            ptr,
        )?;
        set(
            desc,
            A::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
            &fast as *const i8 as _,
            1,
        )?;
        for (attr, scale) in [
            (A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, plan.a_scale),
            (A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, plan.b_scale),
        ] {
            // One scale per operand is the default: set only block modes.
            if scale != LtScale::Scalar {
                let mode = scale_mode(scale) as u32;
                set(desc, attr, &mode as *const u32 as _, 4)?;
            }
        }
    }
    let out = match plan.out {
        LtOut::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        LtOut::AccumulateF32 => sys::cudaDataType::CUDA_R_32F,
    };
    descs
        .layouts
        .push(layout(data_type(plan.a_format), &plan.a)?);
    descs
        .layouts
        .push(layout(data_type(plan.b_format), &plan.b)?);
    descs.layouts.push(layout(out, &plan.d)?);
    let [al, bl, dl] = [descs.layouts[0], descs.layouts[1], descs.layouts[2]];
    // D's alignment in bytes (a power of two, at most 256); A and B are fresh allocations.
    let align = 1u32 << d.trailing_zeros().min(8);
    let algo = {
        let mut algos = h.algos.lock().unwrap_or_else(|e| e.into_inner());
        match algos.get(&(*plan, align)) {
            Some(a) => *a,
            None => {
                use sys::cublasLtMatmulPreferenceAttributes_t as P;
                let pref = lt::create_matmul_pref().map_err(|e| lt_err("preference", e))?;
                let size = WORKSPACE;
                let u32s = std::mem::size_of::<u32>();
                // SAFETY: a live preference; each attribute has the value's type and size.
                let found = unsafe {
                    let usize_ = std::mem::size_of::<usize>();
                    let ws = &size as *const usize as _;
                    let al_ = &align as *const u32 as _;
                    lt::set_matmul_pref_attribute(
                        pref,
                        P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        ws,
                        usize_,
                    )
                    .and_then(|_| {
                        lt::set_matmul_pref_attribute(
                            pref,
                            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                            al_,
                            u32s,
                        )
                    })
                    .and_then(|_| {
                        lt::set_matmul_pref_attribute(
                            pref,
                            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                            al_,
                            u32s,
                        )
                    })
                    .and_then(|_| {
                        lt::get_matmul_algo_heuristic(h.handle, desc, al, bl, dl, dl, pref)
                    })
                };
                // SAFETY: created above, destroyed once.
                let _ = unsafe { lt::destroy_matmul_pref(pref) };
                let found = found.map_err(|e| {
                    lt_err(
                        &format!("has no FP8 algorithm for {plan:?} (sm_89 or newer?)"),
                        e,
                    )
                })?;
                algos.insert((*plan, align), found.algo);
                found.algo
            }
        }
    };
    let (alpha, beta) = (
        1f32,
        if plan.out == LtOut::AccumulateF32 {
            1f32
        } else {
            0f32
        },
    );
    let stream = dev.cuda_stream();
    let (ws, _ws) = h.workspace.device_ptr(&stream);
    // SAFETY: the caller's buffers, described by the layouts above; C = D.
    unsafe {
        lt::matmul(
            h.handle,
            desc,
            &alpha as *const f32 as _,
            &beta as *const f32 as _,
            a as *const c_void,
            al,
            b as *const c_void,
            bl,
            d as *const c_void,
            dl,
            d as *mut c_void,
            dl,
            &algo,
            ws as *mut c_void,
            WORKSPACE,
            stream.cu_stream() as _,
        )
    }
    .map_err(|e| lt_err(&format!("matmul {plan:?}"), e))
}

/// A packed operand (`ops::Fp8Operand`'s codes) and where its parts lie.
pub type Packed<'a> = ((&'a CudaStorage, &'a Layout), Packing);

/// The device addresses of a packed operand's codes (`transposed` or as laid out) and their
/// scales, and how a GEMM scales them.
fn parts(
    op: &str,
    ((s, l), p): Packed,
    transposed: bool,
    dev: &CudaDevice,
) -> Result<([u64; 2], LtScale)> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{op}: a packed FP8 operand must be contiguous")
    };
    let (Some(part), true) = (p.part(transposed), end - start == p.len && start % 256 == 0) else {
        bail!(
            "{op}: the packed operand ({} bytes from byte {start}) is not the whole aligned \
             buffer with the {} codes the GEMM reads ({p:?})",
            end - start,
            if transposed { "transposed" } else { "laid-out" }
        )
    };
    let bytes = s
        .as_cuda_slice::<u8>()
        .map_err(|_| candle_core::Error::Msg(format!("{op}: packed operands are u8")))?;
    let stream = dev.cuda_stream();
    let (base, _g) = bytes.device_ptr(&stream); // one stream: the GEMM queued after is ordered
    let base = base + start as u64;
    let at = [base + part.codes as u64, base + part.scales as u64];
    Ok((at, part.scale()?))
}

/// `plan`'s product of packed operands `a` and `b` (codes and inverse scales: `[codes, scales]`
/// device addresses) into a fresh bf16 buffer of `len` elements (zeros without a GEMM when the
/// plan is empty).
fn into_bf16(
    dev: &CudaDevice,
    plan: &LtGemm,
    a: [u64; 2],
    b: [u64; 2],
    len: usize,
) -> Result<CudaStorage> {
    if plan.m * plan.n * plan.k == 0 {
        let zeros = super::zeros::<half::bf16>(dev, len)?;
        return Ok(CudaStorage::wrap_cuda_slice(zeros, dev.clone()));
    }
    // SAFETY: every element is written by the GEMM.
    let mut d = unsafe { alloc::<half::bf16>(dev, len) }?;
    let stream = dev.cuda_stream();
    let (dp, _d) = d.device_ptr_mut(&stream);
    // SAFETY: the packed operands hold what the plan's A and B address and their scales (the
    // caller's storages outlive the queued call: candle frees on the same stream), and D its
    // `len` outputs.
    unsafe { matmul(dev, plan, (a[0], b[0]), (a[1], b[1]), dp) }?;
    drop(_d);
    Ok(CudaStorage::wrap_cuda_slice(d, dev.clone()))
}

/// `plan`'s product (a forward or an input gradient) into a fresh bf16 buffer of `m · n`
/// elements from packed operands `a` and `b`, each read transposed or as laid out as the
/// bools say: `y = x · wᵀ` takes `w`'s and `x`'s codes as laid out, `dx = g · w` `w`'s
/// transposed and `g`'s as laid out.
pub fn product(
    plan: LtGemm,
    (a, a_transposed): (Packed, bool),
    (b, b_transposed): (Packed, bool),
) -> Result<CudaStorage> {
    const OP: &str = "fp8 GEMM";
    let dev = a.0 .0.device();
    let ((a, sa), (b, sb)) = (
        parts(OP, a, a_transposed, dev)?,
        parts(OP, b, b_transposed, dev)?,
    );
    let plan = plan.scaled(sa, sb);
    into_bf16(dev, &plan, a, b, (plan.m * plan.n) as usize) // [n, m] row-major
}

/// `dst [out, inp] += g [rows, out]ᵀ · x [rows, inp]` into an f32 buffer view, from the packed
/// transposed codes of `g` (E5M2) and `x` (E4M3).
pub fn add_product(
    (dst, dl): (&mut CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
    x: (&CudaStorage, &Layout),
    (gk, xk): (Packing, Packing),
    (rows, out, inp): (usize, usize, usize),
) -> Result<()> {
    const OP: &str = "fp8-add-product";
    let dev = dst.device().clone();
    let (start, end) = super::flat::slot_range(OP, dl, (out, inp))?;
    if rows == 0 || out * inp == 0 {
        return Ok(());
    }
    let (([a, sa], xs), ([b, sb], gs)) = (
        parts(OP, (x, xk), true, &dev)?,
        parts(OP, (g, gk), true, &dev)?,
    );
    let plan = LtGemm::weight_grad(rows, out, inp).scaled(xs, gs);
    let stream = dev.cuda_stream();
    let aligned = {
        let mut d = super::flat::f32_slot(OP, dst, (start, end))?; // [out, inp]
        let (dp, _d) = d.device_ptr_mut(&stream);
        // FP8 GEMMs want 16-byte aligned operands; a slot at another f32 offset gets the
        // product through an aligned temporary.
        if dp % 16 == 0 {
            // SAFETY: codes of inp·rows and out·rows bytes, one scale each, out·inp f32
            // accumulated.
            unsafe { matmul(&dev, &plan, (a, b), (sa, sb), dp) }?;
            true
        } else {
            false
        }
    };
    if !aligned {
        let mut tmp = super::zeros::<f32>(&dev, out * inp)?; // [out, inp], 0 + product
        {
            let (tp, _t) = tmp.device_ptr_mut(&stream);
            // SAFETY: as above, into a fresh (aligned) buffer of out·inp zeros.
            unsafe { matmul(&dev, &plan, (a, b), (sa, sb), tp) }?;
        }
        let tmp = CudaStorage::wrap_cuda_slice(tmp, dev.clone());
        super::flat::add_into(dst, dl, &tmp, &Layout::contiguous(out * inp), false)?;
    }
    Ok(())
}
