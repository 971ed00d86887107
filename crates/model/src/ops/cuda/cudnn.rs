//! cuDNN's fused attention on bf16 CUDA storage, through the C-ABI shim `cudnn/sdpa.cpp` (built
//! by `build.rs` against the cuDNN frontend's headers). `libcudnn.so.9` is opened by [`load`] at
//! start-up, when the recipe's attention backend is `cudnn`, never by a bare start of the binary.
//!
//! [`attention_fwd`] and [`attention_bwd`] take and return what the project's kernels do
//! (`super::attention`): the output `[b, s, hq, d]` and the log-sum-exp `[b, hq, s]` f32 (cuDNN's
//! softmax statistics are exactly that), and the flat `[nq + 2 nkv]` gradients. A causal call
//! with a document floor runs as a ragged batch of its documents (`sdpa_ragged.rs`): the call
//! uploads the batch's tables, and the statistics, which cuDNN writes token-major for it, are
//! transposed to and from `[b, hq, s]`; its backward runs cuDNN's non-deterministic algorithm
//! where the deterministic one's workspace passes `RAGGED_DETERMINISTIC_WORKSPACE`. Handles (one
//! per CUDA context) and graphs (one per [`SdpaDesc`] and direction) are made on first use and kept
//! for the process's life in one [`GraphCache`]; its lock is held across binding the handle to the
//! device's stream and enqueueing the graph ([`run_graph`]), which is all a call does on the host.
//! A shape cuDNN cannot build a graph for (its engines' limits) is logged once and runs the
//! project's kernels, as f32 and other head dims do; a failure to run a built graph is an error.

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaView, DevicePtr, DevicePtrMut};
use candle_core::cuda::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{bail, Layout, Result};
use half::bf16;

use super::cudnn_ragged::{swap_last, with_tables, Tables};
use super::{alloc, view};
use crate::ops::attention::{Dims, Floor};
use crate::ops::sdpa::SdpaDesc;
use crate::ops::sdpa_cache::{Direction, GraphCache};
use crate::ops::sdpa_ragged::Documents;

const OP: &str = "cuDNN attention";

extern "C" {
    fn pretrain_cudnn_load(msg: *mut c_char, len: usize) -> i64;
    fn pretrain_cudnn_handle(handle: *mut *mut c_void, msg: *mut c_char, len: usize) -> i32;
    fn pretrain_sdpa_build(
        p: *const SdpaDesc,
        backward: i32,
        handle: *mut c_void,
        graph: *mut *mut c_void,
        workspace: *mut i64,
        msg: *mut c_char,
        len: usize,
    ) -> i32;
    fn pretrain_sdpa_free(graph: *mut c_void);
    fn pretrain_sdpa_fwd(
        graph: *mut c_void,
        handle: *mut c_void,
        stream: *mut c_void,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        o: *mut c_void,
        stats: *mut f32,
        b: i64,
        seq_len: *const i32,
        offsets: *const i64,
        workspace: *mut c_void,
        msg: *mut c_char,
        len: usize,
    ) -> i32;
    fn pretrain_sdpa_bwd(
        graph: *mut c_void,
        handle: *mut c_void,
        stream: *mut c_void,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        o: *const c_void,
        d_o: *const c_void,
        stats: *const f32,
        d_q: *mut c_void,
        d_k: *mut c_void,
        d_v: *mut c_void,
        b: i64,
        seq_len: *const i32,
        offsets: *const i64,
        workspace: *mut c_void,
        msg: *mut c_char,
        len: usize,
    ) -> i32;
}

/// A message buffer for the shim's errors.
struct Message([u8; 1024]);

impl Message {
    fn new() -> Self {
        Self([0; 1024])
    }

    fn ptr(&mut self) -> (*mut c_char, usize) {
        (self.0.as_mut_ptr().cast(), self.0.len())
    }

    fn text(&self) -> String {
        let end = self.0.iter().position(|&b| b == 0).unwrap_or(self.0.len());
        String::from_utf8_lossy(&self.0[..end]).into_owned()
    }
}

/// The shim's status as a result, with `what` and its message.
fn status(rc: i32, what: &str, msg: &Message) -> Result<()> {
    if rc != 0 {
        bail!("{OP}: {what}: {}", msg.text())
    }
    Ok(())
}

/// The outcome of [`load`]: the library's version, or why it could not be opened.
static LOADED: OnceLock<std::result::Result<u64, String>> = OnceLock::new();

/// The first cuDNN whose fused attention takes a ragged batch with grouped-query heads and
/// token-major statistics (9.6).
const RAGGED_SINCE: u64 = 90600;

/// Opens `libcudnn.so.9` once per process and returns its version (e.g. 91900); the error names
/// the library and the ways to fix it.
pub fn load() -> Result<u64> {
    let loaded = LOADED.get_or_init(|| {
        let mut msg = Message::new();
        let (m, len) = msg.ptr();
        // SAFETY: `m` points at `len` writable bytes, which the shim NUL-terminates.
        let version = unsafe { pretrain_cudnn_load(m, len) };
        match u64::try_from(version) {
            Ok(v) if v > 0 => Ok(v),
            _ => Err(msg.text()),
        }
    });
    match loaded {
        Ok(v) => Ok(*v),
        Err(e) => bail!(
            "train.attention is cudnn but libcudnn.so.9 cannot be loaded ({e}). Install it \
             (`pip install nvidia-cudnn-cu13`) and put its lib directory on LD_LIBRARY_PATH \
             (…/site-packages/nvidia/cudnn/lib), or run the project's kernels with \
             `--set train.attention=own`"
        ),
    }
}

/// A shim pointer (a cuDNN handle or graph), shared between threads under the cache's lock.
#[derive(Clone, Copy)]
struct Ptr(*mut c_void);

// SAFETY: the pointees are used only under `CACHE`'s lock.
unsafe impl Send for Ptr {}

/// A built graph and the workspace bytes a run of it needs.
#[derive(Clone, Copy)]
struct Graph {
    ptr: Ptr,
    workspace: usize,
}

static CACHE: LazyLock<Mutex<GraphCache<Ptr, Graph>>> = LazyLock::new(Mutex::default);

/// Graph runs enqueued so far (forward and backward).
static RUNS: AtomicU64 = AtomicU64::new(0);

/// Attention calls (forward or backward) cuDNN has run in this process: what tells a caller that
/// a call ran there rather than on the project's kernels.
pub fn runs() -> u64 {
    RUNS.load(Ordering::Relaxed)
}

/// What one run of a graph gets: the graph, its handle and stream, a workspace of the graph's
/// size and a message buffer.
struct Run {
    graph: *mut c_void,
    handle: *mut c_void,
    stream: *mut c_void,
    workspace: *mut c_void,
    msg: *mut c_char,
    len: usize,
}

/// Runs `call` on the graph of `desc` in direction `dir` on `dev` (the context's handle and the
/// graph made on first use, the context bound to this thread, the cache locked throughout);
/// `call` makes the outputs, enqueues the graph and returns the shim's status with them, which
/// becomes an error naming `what`. `None` when cuDNN cannot build the graph: the first such call
/// logs the reason, and the caller runs the project's kernels.
fn run_graph<R>(
    dev: &CudaDevice,
    desc: &SdpaDesc,
    dir: Direction,
    what: &str,
    call: impl FnOnce(Run) -> Result<(i32, R)>,
) -> Result<Option<R>> {
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread().w()?;
    let key = ctx.cu_ctx() as usize;
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let handle = cache.handle(key, || {
        let mut msg = Message::new();
        let (m, len) = msg.ptr();
        let mut h = std::ptr::null_mut();
        // SAFETY: `h` receives a handle; `m` points at `len` writable bytes.
        let rc = unsafe { pretrain_cudnn_handle(&mut h, m, len) };
        status(rc, "creating a handle", &msg)?;
        Ok(Ptr(h))
    })?;
    let built = cache.graph(key, desc, dir, || {
        let graph = build(handle, desc, dir)?;
        let Some(lighter) = (dir == Direction::Backward)
            .then(|| desc.lighter_backward(graph.workspace))
            .flatten()
        else {
            return Ok(graph);
        };
        let light = match build(handle, &lighter, dir) {
            Ok(light) => light,
            Err(e) => {
                tracing::warn!(
                    "cuDNN's non-deterministic attention backward cannot be built for {} \
                     documents of up to {} positions ({e}); its deterministic one runs, with {} \
                     MiB of workspace",
                    desc.b,
                    desc.sq,
                    graph.workspace >> 20
                );
                return Ok(graph);
            }
        };
        // SAFETY: `graph` came from the shim's build, never ran and is dropped here.
        unsafe { pretrain_sdpa_free(graph.ptr.0) };
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::warn!(
                "documents kept apart on cuDNN: its deterministic attention backward needs {} \
                 MiB of workspace for {} documents of up to {} positions; these calls run its \
                 non-deterministic backward ({} MiB), whose gradients may differ in the last \
                 bits from run to run (train.attention=own keeps them deterministic)",
                graph.workspace >> 20,
                desc.b,
                desc.sq,
                light.workspace >> 20
            )
        });
        Ok(light)
    });
    let graph = match built {
        Ok(g) => g,
        Err(refusal) => {
            if refusal.first {
                tracing::warn!(
                    "cuDNN cannot run the attention {what} of {desc:?}; calls of this shape run \
                     the project's kernels ({})",
                    refusal.reason
                );
            }
            return Ok(None);
        }
    };
    // SAFETY: the graph uses its workspace as scratch only.
    let mut ws = unsafe { alloc::<u8>(dev, graph.workspace) }?;
    let (wp, _w) = ws.device_ptr_mut(&stream);
    let mut msg = Message::new();
    let (m, len) = msg.ptr();
    let (rc, out) = call(Run {
        graph: graph.ptr.0,
        handle: handle.0,
        stream: stream.cu_stream().cast(),
        workspace: wp as *mut c_void,
        msg: m,
        len,
    })?;
    status(rc, what, &msg)?;
    RUNS.fetch_add(1, Ordering::Relaxed);
    Ok(Some(out))
}

/// The contiguous bf16 data of `(storage, layout)`, which must hold `want` elements.
fn input<'a>(
    name: &str,
    (storage, layout): (&'a CudaStorage, &Layout),
    want: usize,
) -> Result<CudaView<'a, bf16>> {
    let v = view::<bf16>(OP, name, storage, layout)?;
    if v.len() != want {
        bail!("{OP}: `{name}` has {} elements, expected {want}", v.len())
    }
    Ok(v)
}

/// Builds the graph of `desc` in direction `dir` with `handle` (made in the current context).
fn build(handle: Ptr, desc: &SdpaDesc, dir: Direction) -> Result<Graph> {
    let mut msg = Message::new();
    let (m, len) = msg.ptr();
    let (mut g, mut ws) = (std::ptr::null_mut(), 0i64);
    let backward = i32::from(dir == Direction::Backward);
    // SAFETY: `desc` is a valid `PretrainSdpa` (same layout, `#[repr(C)]`); `handle` was made by
    // the shim in this context; `g`, `ws` receive the graph and its workspace size.
    let rc = unsafe { pretrain_sdpa_build(desc, backward, handle.0, &mut g, &mut ws, m, len) };
    status(rc, "building the graph", &msg)?;
    let workspace = usize::try_from(ws).unwrap_or(0);
    tracing::debug!("cuDNN attention {dir:?} graph of {desc:?}: workspace {workspace} bytes");
    Ok(Graph {
        ptr: Ptr(g),
        workspace,
    })
}

/// A call's description and, for documents kept apart, its documents: `None` when its floor is
/// not a split into documents (a ring block) or the loaded cuDNN predates ragged batches
/// ([`RAGGED_SINCE`]), which the project's kernels run.
fn describe(
    dm: Dims,
    floor: Floor<'_>,
    scale: f64,
    deterministic: bool,
) -> Result<Option<(SdpaDesc, Option<Documents>)>> {
    if floor.is_none() {
        return Ok(Some((SdpaDesc::new(dm, scale, deterministic)?, None)));
    }
    let ragged = matches!(LOADED.get(), Some(Ok(v)) if *v >= RAGGED_SINCE);
    Ok(match Documents::from_floor(dm, floor).filter(|_| ragged) {
        Some(docs) => {
            let desc = SdpaDesc::documents(dm, scale, deterministic, &docs)?;
            Some((desc, Some(docs)))
        }
        None => None,
    })
}

/// The forward of `dm` on contiguous bf16 `q` `[b, s, hq, d]`, `k`, `v` `[b, sk, hkv, d]`, with
/// documents kept apart when `floor` is given: the output `[b, s, hq, d]` bf16 and the
/// log-sum-exp of the scaled scores `[b, hq, s]` f32; `None` when cuDNN cannot run this call.
pub(crate) fn attention_fwd(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    (dm, floor): (Dims, Floor<'_>),
    scale: f64,
) -> Result<Option<(CudaStorage, CudaStorage)>> {
    let Some((desc, docs)) = describe(dm, floor, scale, true)? else {
        return Ok(None);
    };
    let (nq, nkv) = desc.sizes();
    let dev = q.0.device();
    let stream = dev.cuda_stream();
    let qv = input("q", q, nq)?; // [b, s, hq, d]
    let kv = input("k", k, nkv)?; // [b, sk, hkv, d]
    let vv = input("v", v, nkv)?; // [b, sk, hkv, d]
    let ran = run_graph(dev, &desc, Direction::Forward, "forward", |r| {
        let tables = Tables::upload(dev, docs.as_ref(), dm)?;
        // SAFETY: the graph writes every element of the output and of the statistics (a ragged
        // batch's documents cover every token).
        let mut out = unsafe { alloc::<bf16>(dev, nq) }?; // [b, s, hq, d]
        let mut lse = unsafe { alloc::<f32>(dev, dm.b * dm.hq * dm.s) }?; // [b, hq, s] or [b, s, hq]
        let rc = {
            let (qp, _q) = qv.device_ptr(&stream);
            let (kp, _k) = kv.device_ptr(&stream);
            let (vp, _v) = vv.device_ptr(&stream);
            let (op, _o) = out.device_ptr_mut(&stream);
            let (lp, _l) = lse.device_ptr_mut(&stream);
            // SAFETY: the graph was built for `desc`, whose sizes and strides describe these
            // buffers (checked lengths, contiguous [b, s, h, d]); the statistics buffer holds
            // b·hq·s floats; a ragged graph's tables hold its batch's lengths and offsets, which
            // address whole documents inside these buffers; everything lives on the stream's
            // device and is used in stream order.
            with_tables(&tables, &stream, |batch, seq, off| unsafe {
                pretrain_sdpa_fwd(
                    r.graph,
                    r.handle,
                    r.stream,
                    qp as *const c_void,
                    kp as *const c_void,
                    vp as *const c_void,
                    op as *mut c_void,
                    lp as *mut f32,
                    batch,
                    seq,
                    off,
                    r.workspace,
                    r.msg,
                    r.len,
                )
            })
        };
        Ok((rc, (out, lse)))
    })?;
    let Some((out, lse)) = ran else {
        return Ok(None);
    };
    let mut lse = CudaStorage::wrap_cuda_slice(lse, dev.clone());
    if docs.is_some() {
        lse = swap_last((&lse, &Layout::contiguous((dm.b, dm.s, dm.hq))))?; // [b, hq, s]
    }
    Ok(Some((CudaStorage::wrap_cuda_slice(out, dev.clone()), lse)))
}

/// The backward of `dm` (with documents kept apart when `floor` is given) from the forward's
/// `out` and log-sum-exp `lse` and the output gradient `dout` (bf16 `[b, s, hq, d]`; lse f32
/// `[b, hq, s]`): the flat `[nq + 2 nkv]` bf16 concatenation of dQ `[b, s, hq, d]`, dK and dV
/// `[b, sk, hkv, d]`; `None` when cuDNN cannot run this call. On cuDNN's deterministic
/// algorithm, or (`deterministic` false) its faster one that accumulates dQ with atomics.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_bwd(
    [q, k, v]: [(&CudaStorage, &Layout); 3],
    out: (&CudaStorage, &Layout),
    dout: (&CudaStorage, &Layout),
    lse: (&CudaStorage, &Layout),
    (dm, floor): (Dims, Floor<'_>),
    scale: f64,
    deterministic: bool,
) -> Result<Option<CudaStorage>> {
    let Some((desc, docs)) = describe(dm, floor, scale, deterministic)? else {
        return Ok(None);
    };
    let (nq, nkv) = desc.sizes();
    let dev = q.0.device();
    let stream = dev.cuda_stream();
    let qv = input("q", q, nq)?; // [b, s, hq, d]
    let kv = input("k", k, nkv)?; // [b, sk, hkv, d]
    let vv = input("v", v, nkv)?;
    let ov = input("out", out, nq)?; // [b, s, hq, d]
    let dov = input("dout", dout, nq)?;
    if lse.1.dims() != [dm.b, dm.hq, dm.s] {
        bail!("{OP}: `lse` is {:?}, expected [b, hq, s]", lse.1.dims())
    }
    let token_layout = Layout::contiguous((dm.b, dm.s, dm.hq));
    let ran = run_graph(dev, &desc, Direction::Backward, "backward", |r| {
        let tables = Tables::upload(dev, docs.as_ref(), dm)?;
        // A ragged graph reads the statistics token-major.
        let token_major = docs.as_ref().map(|_| swap_last(lse)).transpose()?; // [b, s, hq]
        let lse = match &token_major {
            Some(t) => (t, &token_layout),
            None => lse,
        };
        let lv = view::<f32>(OP, "lse", lse.0, lse.1)?;
        if lv.len() != dm.b * dm.hq * dm.s {
            bail!("{OP}: `lse` has {} elements, expected b·hq·s", lv.len())
        }
        // SAFETY: the graph writes every element of dQ, dK and dV.
        let mut grads = unsafe { alloc::<bf16>(dev, nq + 2 * nkv) }?; // [nq + 2 nkv]
        let rc = {
            let (qp, _q) = qv.device_ptr(&stream);
            let (kp, _k) = kv.device_ptr(&stream);
            let (vp, _v) = vv.device_ptr(&stream);
            let (op, _o) = ov.device_ptr(&stream);
            let (dop, _do) = dov.device_ptr(&stream);
            let (lp, _l) = lv.device_ptr(&stream);
            let (gp, _g) = grads.device_ptr_mut(&stream);
            let at = |n: usize| (gp + (n * std::mem::size_of::<bf16>()) as u64) as *mut c_void;
            // SAFETY: as for the forward; dQ, dK and dV are the disjoint parts [0, nq),
            // [nq, nq + nkv) and [nq + nkv, nq + 2 nkv) of `grads`, with the strides of q, k,
            // v.
            with_tables(&tables, &stream, |batch, seq, off| unsafe {
                pretrain_sdpa_bwd(
                    r.graph,
                    r.handle,
                    r.stream,
                    qp as *const c_void,
                    kp as *const c_void,
                    vp as *const c_void,
                    op as *const c_void,
                    dop as *const c_void,
                    lp as *const f32,
                    at(0),
                    at(nq),
                    at(nq + nkv),
                    batch,
                    seq,
                    off,
                    r.workspace,
                    r.msg,
                    r.len,
                )
            })
        };
        Ok((rc, grads))
    })?;
    Ok(ran.map(|grads| CudaStorage::wrap_cuda_slice(grads, dev.clone())))
}
