//! The raw CUDA and NCCL handles of the `nccl` backend: [`RawComm`] (one NCCL communicator, with
//! an abort callable from any thread, and the [`CommStream`] its operations run on),
//! communicator creation on a helper thread, and device addresses of candle tensors.
//!
//! # Safety argument
//!
//! An `ncclComm_t` may be used from any thread but not by two threads at once. Every call on a
//! [`RawComm`] (enqueueing an operation, polling its asynchronous error) runs with its `lock`
//! held and only while `aborted` is false; `ncclCommAbort` runs exactly once (guarded by the
//! `aborted` swap), normally with the lock held. Only when another thread has held the lock for
//! longer than [`ABORT_GRACE`] (a call stuck inside NCCL, e.g. connecting to a dead peer) is the
//! abort issued without the lock, which is how NCCL expects a blocked call to be interrupted (the
//! PyTorch watchdog does the same); the stuck call then returns and nobody uses the handle again.

use std::ffi::{c_char, c_void, CStr};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use candle_core::backend::BackendDevice;
use candle_core::cuda::cudarc::driver::{
    result as cu, CudaContext, CudaSlice, CudaStream, DevicePtr,
};
use candle_core::cuda::cudarc::nccl::{result as nc, sys};
use candle_core::cuda::{CudaDevice, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{DType, Error, Result, Shape, Storage, Tensor};

/// How long an abort waits for an in-progress NCCL call to finish before aborting under it.
pub(super) const ABORT_GRACE: Duration = Duration::from_millis(100);

/// A CUDA driver error as a candle error.
pub(super) fn cuda_err(what: &str, e: cu::DriverError) -> Error {
    Error::msg(format!("nccl backend: CUDA {what}: {e}"))
}

/// NCCL's element type for a candle dtype, if NCCL has one.
pub(super) fn nccl_dtype(dtype: DType) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t as N;
    Some(match dtype {
        DType::U8 => N::ncclUint8,
        DType::U32 => N::ncclUint32,
        DType::I32 => N::ncclInt32,
        DType::I64 => N::ncclInt64,
        DType::F16 => N::ncclFloat16,
        DType::BF16 => N::ncclBfloat16,
        DType::F32 => N::ncclFloat32,
        DType::F64 => N::ncclFloat64,
        _ => return None,
    })
}

fn slice_addr<T>(s: &CudaSlice<T>, offset: usize, stream: &CudaStream) -> u64 {
    // With cudarc's event tracking (on: the device's context is in multi-stream mode), this makes
    // `stream` wait for the slice's last write and the dropped guard records a read on `stream`
    // now, i.e. before the NCCL operation is enqueued. Callers pass the device's stream, order the
    // communicator's stream after it themselves, and keep the tensor alive until the GPU is done.
    let (ptr, _guard) = s.device_ptr(stream);
    ptr + (offset * std::mem::size_of::<T>()) as u64
}

/// Device address of the first element of `t`, a contiguous CUDA tensor of a dtype
/// [`nccl_dtype`] accepts. The caller keeps `t` alive until the GPU no longer uses the address.
pub(super) fn device_addr(t: &Tensor, stream: &CudaStream) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        return Err(Error::msg("nccl backend: tensor is not on a CUDA device"));
    };
    let off = layout.start_offset();
    Ok(match &s.slice {
        CudaStorageSlice::U8(x) => slice_addr(x, off, stream),
        CudaStorageSlice::U32(x) => slice_addr(x, off, stream),
        CudaStorageSlice::I32(x) => slice_addr(x, off, stream),
        CudaStorageSlice::I64(x) => slice_addr(x, off, stream),
        CudaStorageSlice::F16(x) => slice_addr(x, off, stream),
        CudaStorageSlice::BF16(x) => slice_addr(x, off, stream),
        CudaStorageSlice::F32(x) => slice_addr(x, off, stream),
        CudaStorageSlice::F64(x) => slice_addr(x, off, stream),
        _ => {
            let dtype = t.dtype();
            return Err(Error::msg(format!(
                "nccl backend: no NCCL type for {dtype:?}"
            )));
        }
    })
}

/// A fresh, uninitialised contiguous tensor on `device` (allocated on the device's stream).
pub(super) fn alloc(device: &CudaDevice, shape: Shape, dtype: DType) -> Result<Tensor> {
    // SAFETY: the contents are written by the NCCL operation before the tensor is handed out.
    let storage = unsafe { device.alloc_uninit(&shape, dtype)? };
    let storage = Storage::Cuda(storage);
    Ok(Tensor::from_storage(
        storage,
        shape,
        BackpropOp::none(),
        false,
    ))
}

/// An NCCL error as text: the code, and NCCL's last error message when it has one.
pub(super) fn describe(code: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    // SAFETY: NCCL returns a NUL-terminated static or per-thread string (or null).
    let last = unsafe { sys::ncclGetLastError(comm) };
    let last = if last.is_null() {
        String::new()
    } else {
        unsafe { CStr::from_ptr(last) }
            .to_string_lossy()
            .into_owned()
    };
    if last.is_empty() {
        format!("{code:?}")
    } else {
        format!("{code:?}: {last}")
    }
}

/// Why a call on a [`RawComm`] did not go through.
pub(super) enum Fault {
    /// The communicator was aborted (by this rank's failure handling).
    Aborted,
    /// NCCL refused the call; `usage` for invalid arguments or usage (a bug of the caller).
    Nccl { usage: bool, message: String },
}

/// The communicator handle (see the module's safety argument).
struct Handle(sys::ncclComm_t);

// SAFETY: see the module documentation: uses are serialised by `RawComm::lock`, except the one
// abort that NCCL allows to interrupt a stuck call.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

/// One NCCL communicator of this rank, with the stream its operations run on.
pub(super) struct RawComm {
    handle: Handle,
    lock: Mutex<()>,
    aborted: AtomicBool,
    /// Dropped (destroyed) after `Drop::drop` has aborted the communicator.
    stream: CommStream,
}

impl RawComm {
    /// Runs `f` on the handle, unless the communicator has been aborted.
    pub(super) fn call(
        &self,
        f: impl FnOnce(sys::ncclComm_t) -> std::result::Result<nc::NcclStatus, nc::NcclError>,
    ) -> std::result::Result<(), Fault> {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        if self.aborted.load(Ordering::SeqCst) {
            return Err(Fault::Aborted);
        }
        f(self.handle.0).map(|_| ()).map_err(|e| {
            let usage = matches!(
                e.0,
                sys::ncclResult_t::ncclInvalidArgument | sys::ncclResult_t::ncclInvalidUsage
            );
            // A call that an abort interrupted must not touch the freed handle.
            let comm = if self.is_aborted() {
                std::ptr::null_mut()
            } else {
                self.handle.0
            };
            let message = describe(e.0, comm);
            Fault::Nccl { usage, message }
        })
    }

    /// The communicator's own stream: every operation on it is enqueued there (see the module
    /// documentation of `nccl`, "Streams").
    pub(super) fn stream(&self) -> &CudaStream {
        self.stream.stream()
    }

    /// Whether [`RawComm::abort`] has been called.
    pub(super) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// The asynchronous error NCCL recorded for this communicator (a failed peer or network), if
    /// any. Skips the check (returns `None`) while another thread is inside an NCCL call.
    pub(super) fn async_error(&self) -> Option<String> {
        let _guard = match self.lock.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        if self.is_aborted() {
            return None;
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live handle, used under the lock.
        let rc = unsafe { sys::ncclCommGetAsyncError(self.handle.0, &mut state) };
        use sys::ncclResult_t::{ncclInProgress, ncclSuccess};
        match (rc, state) {
            (ncclSuccess, ncclSuccess | ncclInProgress) => None,
            (ncclSuccess, code) | (code, _) => Some(describe(code, self.handle.0)),
        }
    }

    /// Aborts the communicator: its pending operations end (their events complete) and every
    /// later call fails with [`Fault::Aborted`]. Idempotent; callable from any thread. The
    /// stream stays until the `RawComm` is dropped, as other threads may still hold it.
    pub(super) fn abort(&self) {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        let grace = Instant::now() + ABORT_GRACE;
        loop {
            let guard = match self.lock.try_lock() {
                Ok(g) => Some(g),
                Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(TryLockError::WouldBlock) if Instant::now() < grace => {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                // A call is stuck inside NCCL: abort under it to make it return.
                Err(TryLockError::WouldBlock) => None,
            };
            // SAFETY: `aborted` was false until the swap above, so the handle is live and this
            // is its only abort; see the module documentation for the lock-free case.
            let _ = unsafe { nc::comm_abort(self.handle.0) };
            drop(guard);
            return;
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // Aborting (rather than destroying) never waits for peers. All of this rank's operations
        // have completed or failed by now. The stream is destroyed afterwards, with the fields.
        self.abort();
    }
}

/// The outcome of a communicator creation on the helper thread.
pub(super) type InitResult = std::result::Result<RawComm, String>;

/// Creates this rank's communicator (NCCL rank `index` of `size`) from the 128-byte unique `id`
/// on a helper thread, so that the caller can bound its wait: `ncclCommInitRank` blocks until
/// every member has called it. A communicator finished after the caller gave up (dropped the
/// receiver) is aborted.
pub(super) fn spawn_init(
    ctx: Arc<CudaContext>,
    id: [u8; 128],
    index: usize,
    size: usize,
) -> Result<mpsc::Receiver<InitResult>> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("nccl-init".into())
        .spawn(move || {
            let made = init(&ctx, id, index, size);
            // On a send failure the result is dropped here, which aborts the communicator.
            let _ = tx.send(made);
        })
        .map_err(|e| Error::msg(format!("nccl backend: cannot spawn init thread: {e}")))?;
    Ok(rx)
}

fn init(ctx: &Arc<CudaContext>, id: [u8; 128], index: usize, size: usize) -> InitResult {
    ctx.bind_to_thread()
        .map_err(|e| format!("CUDA bind: {e}"))?;
    // Made first, so that a failure leaves no communicator behind.
    let stream = CommStream::new(ctx).map_err(|e| e.to_string())?;
    let id = sys::ncclUniqueId {
        internal: id.map(|b| b as c_char),
    };
    let (nranks, rank) = (size as i32, index as i32);
    let mut comm = MaybeUninit::<sys::ncclComm_t>::uninit();
    // SAFETY: `comm` is a valid out-pointer; NCCL initialises it on success.
    unsafe { nc::comm_init_rank(comm.as_mut_ptr(), nranks, id, rank) }
        .map_err(|e| describe(e.0, std::ptr::null_mut()))?;
    Ok(RawComm {
        // SAFETY: initialised by the successful call above.
        handle: Handle(unsafe { comm.assume_init() }),
        lock: Mutex::new(()),
        aborted: AtomicBool::new(false),
        stream,
    })
}

/// NCCL's 128-byte unique id for a new communicator, as bytes for the store.
pub(super) fn new_unique_id() -> std::result::Result<[u8; 128], String> {
    let id = nc::get_uniqueid().map_err(|e| describe(e.0, std::ptr::null_mut()))?;
    Ok(id.internal.map(|c| c as u8))
}

/// A non-blocking CUDA stream owned by one [`RawComm`], on which all of that communicator's
/// operations run (so they never hold up, nor are held up by, the device's stream or another
/// communicator's operations). Created with the raw driver call and wrapped as a borrowed stream
/// rather than with `CudaContext::new_stream`: the device's context is already in cudarc's
/// multi-stream mode (candle's `Device::new_cuda_with_stream` made its stream with `new_stream`),
/// so either would do there; the raw call leaves cudarc's stream count (and so its event tracking
/// and the one-off context synchronise of a first `new_stream`) untouched even for a device
/// created otherwise, and ties the stream's lifetime explicitly to this struct.
pub(super) struct CommStream {
    stream: Arc<CudaStream>,
}

impl CommStream {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        let raw = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| cuda_err("stream create", e))?;
        // SAFETY: `raw` is a stream of `ctx` owned by this struct, destroyed in `Drop` after the
        // wrapper's last use (the wrapper never leaves this struct).
        let stream = unsafe { ctx.wrap_borrowed_stream(raw) };
        Ok(Self { stream })
    }

    pub(super) fn stream(&self) -> &CudaStream {
        &self.stream
    }
}

impl Drop for CommStream {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: see `new`; pending work finishes before CUDA releases the stream.
        let _ = unsafe { cu::stream::destroy(self.stream.cu_stream()) };
    }
}

/// Raw pointers of one NCCL launch.
pub(super) struct Launch {
    pub comm: sys::ncclComm_t,
    pub send: *const c_void,
    pub recv: *mut c_void,
    pub dtype: sys::ncclDataType_t,
    pub stream: sys::cudaStream_t,
}
