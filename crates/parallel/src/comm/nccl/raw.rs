//! The raw CUDA and NCCL handles of the `nccl` backend: [`RawComm`] (one non-blocking NCCL
//! communicator, guarded by `comm::guard`, with the [`CommStream`] its operations run on),
//! communicator creation, and device addresses of candle tensors.
//!
//! # Safety argument
//!
//! An `ncclComm_t` may be used from any thread but not by two threads at once, and a
//! non-blocking one not before its last call has settled. [`RawComm`] holds the handle in a
//! [`Guarded`], which serialises every use (calls, status polls, the abort), settles each call
//! NCCL answers `ncclInProgress` before the next may start, and makes `ncclCommAbort` the
//! handle's single, last use, issued only between polls, never under a call in NCCL (see
//! `comm::guard`). Communicators are made non-blocking (`ncclCommInitRankConfig`, `blocking =
//! 0`), so no NCCL call holds the handle for long: connection set-up and initialisation run on
//! NCCL's own threads while the guard polls. `NCCL_COMM_BLOCKING=1` would override that and is
//! refused ([`check_nonblocking_env`], and [`start_init`] for NCCL's configuration files).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

use candle_core::backend::BackendDevice;
use candle_core::cuda::cudarc::driver::{
    result as cu, CudaContext, CudaSlice, CudaStream, DevicePtr,
};
use candle_core::cuda::cudarc::nccl::{result as nc, sys};
use candle_core::cuda::{CudaDevice, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{DType, Error, Result, Shape, Storage, Tensor};

pub(super) use crate::comm::guard::Fault;
use crate::comm::guard::{AsyncHandle, Guarded, Status};

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

/// An NCCL error as text: the code, and NCCL's last error message when it has one (one string
/// per process in NCCL: after several failures it may describe another communicator's).
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

/// The communicator handle as the guard sees it.
struct Handle(sys::ncclComm_t);

// SAFETY: see the module documentation: every use is serialised by the `Guarded` lock.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl AsyncHandle for Handle {
    fn status(&self) -> Status {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live handle (the guard calls this only before the abort), used under the
        // guard's lock.
        let rc = unsafe { sys::ncclCommGetAsyncError(self.0, &mut state) };
        use sys::ncclResult_t::{ncclInProgress, ncclSuccess};
        match (rc, state) {
            (ncclSuccess, ncclSuccess) => Status::Ready,
            (ncclSuccess, ncclInProgress) => Status::InProgress,
            (ncclSuccess, code) | (code, _) => Status::Failed(describe(code, self.0)),
        }
    }

    fn abort(&self) {
        // SAFETY: the guard makes this the handle's single, last use. Pending operations end
        // (their events complete); NCCL frees the communicator.
        let _ = unsafe { nc::comm_abort(self.0) };
    }
}

/// One NCCL communicator of this rank, with the stream its operations run on. Field order is
/// drop order: the communicator is aborted (the guard's drop) before its stream is destroyed.
pub(super) struct RawComm {
    comm: Guarded<Handle>,
    stream: CommStream,
}

impl RawComm {
    /// Enqueues one operation (or one NCCL group): runs `f` on the handle, unless the
    /// communicator has been aborted, and settles it if NCCL answers `ncclInProgress`, so that
    /// on return the operation is on the communicator's stream.
    pub(super) fn call(
        &self,
        f: impl FnOnce(sys::ncclComm_t) -> std::result::Result<nc::NcclStatus, nc::NcclError>,
    ) -> std::result::Result<(), Fault> {
        self.comm.call(|h| match f(h.0) {
            Ok(nc::NcclStatus::InProgress) => Ok(true),
            Ok(_) => Ok(false),
            Err(e) => Err(Fault::Failed {
                usage: matches!(
                    e.0,
                    sys::ncclResult_t::ncclInvalidArgument | sys::ncclResult_t::ncclInvalidUsage
                ),
                message: describe(e.0, h.0),
            }),
        })
    }

    /// Whether the communicator's initialisation has finished (`Ok(false)` while in progress).
    pub(super) fn ready(&self) -> std::result::Result<bool, Fault> {
        self.comm.ready()
    }

    /// The communicator's own stream: every operation on it is enqueued there (see the module
    /// documentation of `nccl`, "Streams").
    pub(super) fn stream(&self) -> &CudaStream {
        self.stream.stream()
    }

    /// Whether [`RawComm::abort`] has been called.
    pub(super) fn is_aborted(&self) -> bool {
        self.comm.is_aborted()
    }

    /// How many calls NCCL answered `ncclInProgress` (its initialisation included).
    pub(super) fn deferred(&self) -> u64 {
        self.comm.deferred()
    }

    /// The asynchronous error NCCL recorded for this communicator (a failed peer or network), if
    /// any. Skips the check (returns `None`) while another thread's call holds the handle.
    pub(super) fn async_error(&self) -> Option<String> {
        self.comm.failure()
    }

    /// Aborts the communicator: its pending operations end (their events complete) and every
    /// later call fails with [`Fault::Aborted`]. Idempotent; callable from any thread. The
    /// stream stays until the `RawComm` is dropped, as other threads may still hold it.
    pub(super) fn abort(&self) {
        self.comm.abort()
    }
}

/// The configuration of every communicator: NCCL's defaults (`NCCL_CONFIG_INITIALIZER`: the
/// magic, and "undefined" in every field) except `blocking = 0`. Laid out as cudarc's binding
/// (NCCL 2.30.0's struct), so `version` says 2.30.0: NCCL copies `min(size, its own size)` bytes
/// (an older library reads the fields it knows; a newer one resets those newer than `version`
/// to its defaults), so every library from 2.14 on reads it alike (the build ships 2.27).
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF: c_int = c_int::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 2 * 10_000 + 30 * 100,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// Why a blocking communicator is refused: a call stuck in NCCL could then be ended only by an
/// abort under it (see the module documentation).
const NEEDS_NONBLOCKING: &str = "the nccl backend needs non-blocking communicators to bound its \
     waits and abort cleanly";

/// Refuses `NCCL_COMM_BLOCKING` set to 1 (as NCCL reads it: a C integer, so `01` or `0x1`
/// too), which makes every communicator blocking whatever its configuration. NCCL's
/// configuration files can set it too; [`start_init`] catches those.
pub(super) fn check_nonblocking_env() -> std::result::Result<(), String> {
    let value = std::env::var("NCCL_COMM_BLOCKING").unwrap_or_default();
    if crate::env::c_integer(&value) == Some(1) {
        return Err(format!(
            "NCCL_COMM_BLOCKING={value} makes NCCL calls block, and {NEEDS_NONBLOCKING}: unset it"
        ));
    }
    Ok(())
}

/// Starts creating this rank's communicator (NCCL rank `index` of `size`) from the 128-byte
/// unique `id`, non-blocking: NCCL initialises it on a thread of its own, which waits until every
/// member has joined; poll [`RawComm::ready`] (dropping the communicator meanwhile aborts it).
pub(super) fn start_init(
    ctx: &Arc<CudaContext>,
    id: [u8; 128],
    index: usize,
    size: usize,
) -> std::result::Result<RawComm, String> {
    ctx.bind_to_thread()
        .map_err(|e| format!("CUDA bind: {e}"))?;
    // Made first, so that a failure leaves no communicator behind.
    let stream = CommStream::new(ctx).map_err(|e| e.to_string())?;
    let id = sys::ncclUniqueId {
        internal: id.map(|b| b as c_char),
    };
    let (nranks, rank) = (size as i32, index as i32);
    let mut config = nonblocking_config();
    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: `comm` and `config` are valid for the call; NCCL sets `comm` once it has made the
    // communicator (also when its initialisation fails later), and leaves it null otherwise.
    let started = unsafe { nc::comm_init_rank_config(&mut comm, nranks, id, rank, &mut config) };
    if comm.is_null() {
        let code = started
            .err()
            .map_or(sys::ncclResult_t::ncclInternalError, |e| e.0);
        return Err(describe(code, std::ptr::null_mut()));
    }
    // From here the guard owns the handle: a failure below is reported by `ready`, and
    // dropping the communicator aborts it.
    let deferred = matches!(started, Ok(nc::NcclStatus::InProgress));
    let made = RawComm {
        comm: Guarded::new(Handle(comm), deferred),
        stream,
    };
    // A non-blocking initialisation runs on NCCL's thread, which takes far longer than the
    // return from this call: one complete on return was blocking.
    if matches!(started, Ok(nc::NcclStatus::Success)) {
        return Err(format!(
            "NCCL made the communicator blocking (NCCL_COMM_BLOCKING=1 in an NCCL \
             configuration file: NCCL_CONF_FILE, ~/.nccl.conf or /etc/nccl.conf?), and \
             {NEEDS_NONBLOCKING}"
        ));
    }
    Ok(made)
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

/// The buffers of one NCCL operation: device addresses (equal, or one inside the other, in
/// place) and NCCL's element type.
#[derive(Clone, Copy)]
pub(super) struct Buffers {
    pub send: *const c_void,
    pub recv: *mut c_void,
    pub dtype: sys::ncclDataType_t,
}

/// Raw pointers of one NCCL launch.
pub(super) struct Launch {
    pub comm: sys::ncclComm_t,
    pub send: *const c_void,
    pub recv: *mut c_void,
    pub dtype: sys::ncclDataType_t,
    pub stream: sys::cudaStream_t,
}
