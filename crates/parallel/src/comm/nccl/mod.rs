//! Backend `nccl`: one process per GPU, collectives and transfers through NCCL. Defines
//! [`NcclComm`].
//!
//! # Design
//!
//! - **Communicators.** One NCCL communicator per [`Group`] this rank uses, created lazily on the
//!   group's first call: member 0 makes an NCCL unique id and `set`s its 128 bytes in the store
//!   under `nccl/{k}/group/{ranks}/id` (`k` numbers the `NcclComm`s of the job, see
//!   [`NcclComm::new`]); every member announces itself (`…/here/{rank}`, `…/count`), waits —
//!   bounded, watching for failures — until all have, reads the id and joins with
//!   `ncclCommInitRankConfig`. Communicators are non-blocking (`blocking = 0`): initialisation,
//!   connection set-up and launches run on NCCL's threads while the calling thread polls, so
//!   every wait stays bounded and an abort never interrupts a call inside NCCL (`raw.rs`,
//!   `comm::guard`; `NCCL_COMM_BLOCKING=1` is refused). Members call a group's
//!   collectives in the same order, so they create its communicator at matching calls.
//!   Creation is serialised per rank. Point-to-point messages use one communicator per
//!   *direction* (`nccl/{k}/p2p/{src}->{dst}`, NCCL rank 0 = sender), created by the sender's
//!   first `send` and the receiver's first `recv` on that direction.
//! - **Streams.** Every communicator (each group, each p2p direction) has its own CUDA stream,
//!   as in PyTorch. Sharing the device's one stream deadlocked real training: the data-parallel
//!   gradient sync (a background thread) and the tensor-parallel collectives (the main thread)
//!   were enqueued on it in an order that depends on thread timing, so with dp=2, tp=2 two ranks
//!   could queue a DP and a TP collective in opposite orders, each NCCL kernel spinning until its
//!   peers join and blocking the kernels behind it on that stream: a cycle. Now operations on
//!   different communicators never wait for each other on the GPU; those on one communicator
//!   keep their issue order, which all members share. To enqueue an operation, the inputs are
//!   made contiguous (copied) and the output allocated on the device's stream
//!   ([`CudaDevice::cuda_stream`]), an event recorded there after that work, the communicator's
//!   stream made to wait for it, the NCCL call enqueued on the communicator's stream and a
//!   completion event recorded behind it. The in-place forms (`in_place.rs`) copy and allocate
//!   nothing, so they wait instead for the hand-off mark of the thread that made their tensor
//!   (an event it recorded on the device stream before handing the tensor over). Collectives
//!   and receives return a fresh tensor of the input's dtype on the same device, detached from
//!   the autograd graph, ordered after the operation in one of two ways ([`Order`]). Called from a compute thread, the device stream is
//!   made to wait for the completion event and the call returns at once: the kernels queued
//!   next use the result on the GPU when it is there, the host goes on queueing, and freeing the
//!   input (stream-ordered on the device stream, behind that wait) cannot hand its memory to
//!   earlier work. The operation joins the pending ones (below) that every later call and the
//!   watchdog check. Called from a communication thread (`comm::thread`: data-parallel buckets,
//!   ZeRO gathers), and for barriers, the calling thread waits for the event instead: the compute
//!   thread picks those results up later, and a wait on the shared device stream would hold the
//!   backward kernels queued after it until the collective finished. The host of a compute
//!   thread therefore waits only where it reads a value (a host tensor's collective, the
//!   step's loss and gradient norm); such a read also reports a job failure that happened
//!   meanwhile (an aborted operation completes, with a meaningless result).
//!   `all_gather` / `reduce_scatter` along `dim ≠ 0` move axes with candle ops around NCCL's
//!   flat, member-major buffers. Sends copy their tensor on the device's stream, then run on
//!   their direction communicator's stream, ordered the same way; `send` returns at once (no
//!   wait for the matching `recv`, as the `local` backend and the pipeline schedules assume).
//!   The copy is held until the send completes (polled on later calls and by the watchdog, like
//!   every pending operation; a later call looks at the oldest ones, the watchdog at all). NCCL
//!   connects a direction at its first send and receive, each waiting for the other, so
//!   `prepare` connects every direction it creates (one byte, waited for): otherwise a first
//!   send would wait on the host for the receiver's first `recv`, which deadlocks any cycle of
//!   ranks that send before they receive. `send_recv` (a ring's hop) is one NCCL group of a send
//!   and a receive on the group's communicator, which connects both together; the device stream
//!   waits for it only when the returned transfer is waited for, so the kernels queued between
//!   overlap it. A communicator's stream is destroyed when the communicator is dropped (after
//!   its abort).
//! - **Bounded waits.** A host-ordered caller polls a CUDA event recorded behind the
//!   operation: spinning for 1 ms, then sleeping 20 µs doubling to 1 ms, up to the timeout;
//!   every 200 ms it also checks NCCL's asynchronous error. A timeout records this rank's failure
//!   and aborts all of its communicators (`ncclCommAbort` ends their kernels) and returns
//!   [`CommError::Timeout`] naming the whole group but this rank (NCCL cannot tell who is
//!   late; communicator creation names the members that never arrived). Afterwards every call
//!   of this rank fails with [`CommError::PeerFailed`] naming it, since the aborted
//!   communicators are gone. A stream-ordered operation is bounded the same way by the pending
//!   list: the watchdog (every 200 ms) and each later call fail the job when one outlives the
//!   timeout (a `Timeout` naming it) or its communicator reports an asynchronous error; the
//!   abort ends the NCCL kernel, so a device stream waiting on it moves on, and a host blocked
//!   in reading a value returns and meets the failure at its next call.
//! - **Failure.** [`Comm::abort`](super::Comm::abort) publishes the failure in the store (`nccl/{k}/abort/claim`:
//!   the first `add` wins and writes `…/rank` and `…/reason`, then bumps `…/count`), records it
//!   and aborts this rank's communicators. A watchdog thread checks `…/count` every 200 ms
//!   while this rank communicates (an operation within the last 5 s, or operations or NCCL
//!   calls pending), every 2 s otherwise, and a call after an idle spell reads it first; once set, the
//!   recorded rank and reason become this rank's failure, its communicators are aborted, and
//!   pending and later calls return `PeerFailed` naming that rank. An unreachable store counts
//!   as the failure of rank 0, which serves it. The watchdog also fails the job when a send or
//!   an NCCL call (e.g. one still settling a connection to a dead peer) outlives the timeout;
//!   the abort ends the settling call at its next poll. Dropping an `NcclComm` waits for its
//!   sends and then (unless the job failed) for every rank to drop theirs, so the store outlives
//!   all traffic.
//! - **Results.** Identical on all members by construction (NCCL delivers one reduced buffer to
//!   everyone), but not bit-identical to the `local` backend's member-order sums: NCCL's
//!   reduction order depends on its algorithm (ring, tree) and on the data size.
//! - **Limits.** Dtypes u8, u32, i32, i64, f16, bf16, f32, f64 (others: [`CommError::Invalid`];
//!   `Max` on any of them). NCCL cannot check that members pass matching shapes and dtypes, or
//!   that a `recv` matches its `send`: a mismatch is undefined (typically a timeout). Sending to
//!   oneself is not supported. Single-member groups never touch NCCL (results are copies).
//!
//! Calls fail with a [`CommError`]; a CUDA or NCCL failure inside a call is its `Invalid` or
//! `Tensor` variant.

mod api;
mod connect;
mod in_place;
mod layout;
mod ops;
mod raw;
mod state;

use std::ptr::null;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::cuda::cudarc::driver::CudaEvent;
use candle_core::cuda::cudarc::nccl::{result as nc, sys};
use candle_core::cuda::CudaDevice;
use candle_core::{DType, Device, Error, Shape, Tensor};

use crate::comm::Result;

use super::{CommError, Group};
use crate::store::Store;
use layout::{instance_key, instance_prefix, CommKey};
use raw::{alloc, cuda_err, device_addr, nccl_dtype, Buffers, Fault, Launch, RawComm};
use state::{Call, PendingOp, Shared, SLOW};

/// One rank's [`Comm`](super::Comm) over NCCL (see the module documentation).
pub struct NcclComm {
    shared: Arc<Shared>,
    watchdog: Option<JoinHandle<()>>,
}

/// A copy of `t`'s values in fresh storage of their size, detached from the autograd graph
/// (candle's `copy` would clone the whole storage a view lies in).
fn fresh(t: &Tensor) -> Result<Tensor> {
    Ok(t.detach().force_contiguous()?)
}

impl NcclComm {
    /// This rank's communicator in a job of `world_size` ranks, on `device` (one GPU per rank),
    /// waiting at most `timeout` for any operation.
    ///
    /// The launcher has connected `store` to the job's rendezvous store already; it is used for
    /// communicator set-up and failure notices only. Every rank of the job calls `new`, and ranks
    /// that create several `NcclComm`s (e.g. a self-test) create them in the same order: the
    /// `k`-th instance of each rank only meets the `k`-th instances of the others. While a rank
    /// communicates, an unreachable store counts as the failure of rank 0 (whose process serves
    /// it), so rank 0 must drop its `NcclComm` before its store server: dropping waits until every
    /// rank has dropped its own (unless the job failed).
    pub fn new(
        rank: usize,
        world_size: usize,
        mut store: Store,
        device: CudaDevice,
        timeout: Duration,
    ) -> candle_core::Result<Self> {
        if rank >= world_size {
            return Err(Error::msg(format!(
                "nccl backend: no rank {rank} in a job of {world_size}"
            )));
        }
        raw::check_nonblocking_env().map_err(|e| Error::msg(format!("nccl backend: {e}")))?;
        let k = store.add(&instance_key(rank), 1).map_err(Error::wrap)?;
        let prefix = instance_prefix(k - 1);
        let shared = Arc::new(Shared::new(
            rank, world_size, timeout, prefix, device, store,
        ));
        let watched = shared.clone();
        let watchdog = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || watched.watch())
            .map_err(|e| Error::msg(format!("nccl backend: cannot spawn watchdog: {e}")))?;
        Ok(Self {
            shared,
            watchdog: Some(watchdog),
        })
    }

    /// The first failure this rank knows of: the failed rank and its reason.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.shared.failure()
    }

    /// How many NCCL calls of this rank (communicator initialisations included) NCCL answered
    /// `ncclInProgress` and the backend settled: evidence that its communicators are
    /// non-blocking.
    pub fn deferred_calls(&self) -> u64 {
        let comms = self.shared.comms.lock().unwrap_or_else(|e| e.into_inner());
        comms.values().map(|c| c.deferred()).sum()
    }

    /// Waits (bounded by the timeout) until every send of this rank has been received and every
    /// stream-ordered operation has completed. Call it before dropping the communicator:
    /// dropping aborts operations still in flight after the timeout.
    pub fn flush_sends(&self) -> Result<()> {
        let pending = self.shared.pending.lock().map(|s| {
            let mut peers: Vec<usize> = s.iter().flat_map(|p| p.peers.clone()).collect();
            peers.sort_unstable();
            peers.dedup();
            peers
        });
        let missing: Vec<usize> = pending.unwrap_or_default();
        let call = self.call("flush_sends", vec![self.shared.rank], missing);
        let deadline = Instant::now() + self.shared.timeout;
        let sh = &self.shared;
        let out = sh.poll(&call, deadline, SLOW, |_| {
            if let Some(f) = sh.reap_pending(true) {
                sh.fail(sh.rank, f.reason.clone());
                return Err(call.peer_failed(sh.rank, f.reason));
            }
            Ok(sh
                .pending
                .lock()
                .map_or(true, |s| s.is_empty())
                .then_some(()))
        });
        out
    }

    fn call(&self, op: &'static str, group: Vec<usize>, missing: Vec<usize>) -> Call {
        let me = self.shared.rank;
        Call {
            me,
            op,
            group,
            missing,
        }
    }

    /// Checks a call on `group` and starts it.
    fn begin(&self, op: &'static str, group: &Group) -> Result<Call> {
        let me = self.shared.rank;
        let missing = group.ranks().iter().copied().filter(|&r| r != me).collect();
        let call = self.call(op, group.ranks().to_vec(), missing);
        if group.index_of(me).is_none() {
            let msg = format!("rank {me} is not a member of the group");
            return Err(call.invalid(msg));
        }
        let n = self.shared.world_size;
        if let Some(&r) = group.ranks().last().filter(|&&r| r >= n) {
            return Err(call.invalid(format!("no rank {r} in a job of {n} ranks")));
        }
        self.start(&call)?;
        Ok(call)
    }

    /// Fails `call` if the job has failed or a pending operation went wrong; marks activity.
    fn start(&self, call: &Call) -> Result<()> {
        let sh = &self.shared;
        sh.resume(call)?;
        if let Some(f) = sh.reap_pending(false) {
            sh.fail(sh.rank, f.reason.clone());
            let e = if f.timed_out {
                CommError::Timeout {
                    me: sh.rank,
                    op: f.op,
                    group: f.group,
                    secs: sh.timeout.as_secs_f64(),
                    missing: f.peers,
                }
            } else {
                call.peer_failed(sh.rank, f.reason)
            };
            return Err(e);
        }
        Ok(())
    }

    /// NCCL's type for `t`, checking that `t` lives on this rank's device.
    fn check_tensor(&self, call: &Call, t: &Tensor) -> Result<sys::ncclDataType_t> {
        let ours = Device::Cuda(self.shared.device.clone());
        if !t.device().same_device(&ours) {
            let msg = format!("tensor on {:?}, expected this rank's {ours:?}", t.device());
            return Err(call.invalid(msg));
        }
        nccl_dtype(t.dtype())
            .ok_or_else(|| call.invalid(format!("dtype {:?} is not supported by NCCL", t.dtype())))
    }

    /// Enqueues `launch` on `comm`, turning NCCL's refusal into the call's error. Any refusal
    /// fails the job: a non-blocking communicator keeps the error of a call it refused and
    /// fails every later one, so even a caller's mistake (`CommError::Invalid`, which NCCL's
    /// argument checks find only when the backend's own checks missed it) leaves it unusable.
    /// On an error the buffers in `touched` are never freed (see [`keep_forever`]).
    fn enqueue(
        &self,
        call: &Call,
        comm: &RawComm,
        touched: &[&Tensor],
        launch: impl FnOnce(sys::ncclComm_t) -> std::result::Result<nc::NcclStatus, nc::NcclError>,
    ) -> Result<()> {
        let sh = &self.shared;
        let ctx = sh.stream.context();
        ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        let outcome = sh.host_call(call.op, || comm.call(launch));
        if outcome.is_err() {
            keep_forever(touched);
        }
        let e = match outcome {
            Ok(()) => return Ok(()),
            Err(Fault::Failed {
                usage: true,
                message,
            }) => {
                let e = call.invalid(format!("NCCL: {message}"));
                sh.fail(sh.rank, e.to_string());
                e
            }
            Err(Fault::Failed { message, .. }) => {
                sh.fail(sh.rank, format!("NCCL error in {}: {message}", call.op));
                let (failed, reason) = sh.failure().unwrap_or((sh.rank, message));
                call.peer_failed(failed, reason)
            }
            Err(Fault::Aborted) => {
                let aborted = (sh.rank, "NCCL communicator aborted".to_string());
                let (failed, reason) = sh.failure().unwrap_or(aborted);
                call.peer_failed(failed, reason)
            }
        };
        Err(e)
    }

    /// A mark of all work enqueued so far on the device's stream (an event recorded there).
    fn device_mark(&self) -> Result<CudaEvent> {
        Ok(self
            .shared
            .stream
            .record_event(None)
            .map_err(|e| cuda_err("event", e))?)
    }

    /// Orders `comm`'s stream after all work enqueued so far on the device's stream (the
    /// operation's inputs and output buffer are made there).
    fn follow_device(&self, comm: &RawComm) -> Result<()> {
        let ready = self.device_mark()?;
        Ok(comm
            .stream()
            .wait(&ready)
            .map_err(|e| cuda_err("stream wait", e))?)
    }

    /// Runs one operation on `key`'s communicator stream, after the device stream's work:
    /// `input` (made contiguous) is NCCL's send buffer (null without), a fresh `shape`/`dtype`
    /// tensor its receive buffer, returned. With `Order::Stream` the device stream is made to
    /// wait for the operation's completion event and the call returns at once (the operation
    /// joins the pending ones the watchdog bounds); with `Order::Host` the calling thread waits
    /// for it (see [`Order`]).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        call: &Call,
        key: CommKey,
        input: Option<&Tensor>,
        shape: Shape,
        dtype: DType,
        order: Order,
        launch: impl FnOnce(&Launch) -> std::result::Result<nc::NcclStatus, nc::NcclError>,
    ) -> Result<Tensor> {
        let sh = &self.shared;
        let nccl_type = nccl_dtype(dtype).ok_or_else(|| {
            Error::from(call.invalid(format!("dtype {dtype:?} is not supported by NCCL")))
        })?;
        let comm = sh.comm(call, &key)?;
        let stream = &sh.stream;
        let input = input.map(Tensor::contiguous).transpose()?;
        let out = alloc(&sh.device, shape, dtype)?;
        let send = match &input {
            Some(t) => device_addr(t, stream)? as *const _,
            None => null(),
        };
        let recv = device_addr(&out, stream)? as *mut _;
        self.follow_device(&comm)?;
        let buffers = Buffers {
            send,
            recv,
            dtype: nccl_type,
        };
        let touched: Vec<&Tensor> = input.iter().chain([&out]).collect();
        self.issue(call, key, &comm, order, &touched, buffers, launch)?;
        Ok(out)
    }

    /// Enqueues `launch` on `comm`'s stream (already ordered after the operation's inputs) and
    /// orders its completion as [`Order`] says. `touched` are the buffers the operation reads or
    /// writes, which the caller keeps until this returns: with `Order::Host` the GPU is done
    /// with them by then, and with `Order::Stream` freeing them afterwards is stream-ordered
    /// behind the device stream's wait for the operation, so their memory is reused only by work
    /// after it. On an error they are never freed, as an aborted operation's kernel may still
    /// use them.
    #[allow(clippy::too_many_arguments)]
    fn issue(
        &self,
        call: &Call,
        key: CommKey,
        comm: &RawComm,
        order: Order,
        touched: &[&Tensor],
        buffers: Buffers,
        launch: impl FnOnce(&Launch) -> std::result::Result<nc::NcclStatus, nc::NcclError>,
    ) -> Result<()> {
        let sh = &self.shared;
        let comm_stream = comm.stream();
        let stream = comm_stream.cu_stream() as sys::cudaStream_t;
        self.enqueue(call, comm, touched, |c| {
            launch(&Launch {
                comm: c,
                send: buffers.send,
                recv: buffers.recv,
                dtype: buffers.dtype,
                stream,
            })
        })?;
        let done = comm_stream
            .record_event(None)
            .map_err(|e| cuda_err("event", e))?;
        let wait = match order.resolve() {
            Order::Stream => None,
            Order::Host => Some(sh.timeout),
            Order::Wait(timeout) => Some(timeout),
        };
        if let Some(timeout) = wait {
            if let Err(e) = sh.wait_event(call, &done, comm, timeout) {
                keep_forever(touched);
                return Err(e);
            }
            return Ok(());
        }
        if let Err(e) = sh.stream.wait(&done) {
            keep_forever(touched);
            return Err(cuda_err("stream wait", e).into());
        }
        let pending = PendingOp {
            done,
            _data: Vec::new(),
            key,
            op: call.op,
            group: call.group.clone(),
            peers: call.missing.clone(),
            since: Instant::now(),
        };
        sh.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(pending);
        Ok(())
    }
}

/// Keeps the memory of `tensors` allocated for the rest of the process: after a failed or
/// aborted NCCL call, a kernel NCCL launched may still read or write it (until the abort has
/// ended it, or for good if the abort never returns), and freeing it would hand the memory to
/// other work. Only a failing job gets here, so the leak is bounded by its exit.
fn keep_forever(tensors: &[&Tensor]) {
    for t in tensors {
        std::mem::forget((*t).clone());
    }
}

/// How the result of an NCCL operation is ordered before its users.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Order {
    /// The device stream waits for the operation; the host does not (collectives and receives
    /// issued by a compute thread: the next kernels use the result, and the host goes on
    /// queueing them).
    Stream,
    /// The calling thread waits for the operation (barriers; every call from a communication
    /// thread, `comm::thread`, whose results the compute thread picks up later: making the
    /// shared device stream wait there would stall the compute queued behind it until the
    /// collective finished, the overlap that thread exists for).
    Host,
    /// As `Host`, waiting up to the given time rather than the communicator's timeout (a
    /// checkpoint's barriers).
    Wait(Duration),
}

impl Order {
    /// `Host` on a communication thread (a `Wait` keeps its time), else `self`.
    fn resolve(self) -> Self {
        if crate::comm::thread::on_comm_thread() && self == Order::Stream {
            Order::Host
        } else {
            self
        }
    }
}

impl Drop for NcclComm {
    /// Waits (bounded) for this rank's sends to be received, stops the watchdog, and — unless the
    /// job failed — waits (bounded) until every rank has dropped its `NcclComm`, so that rank 0
    /// keeps serving the store while other ranks still communicate. Then aborts the
    /// communicators (never waiting for peers).
    fn drop(&mut self) {
        if self.shared.failure().is_none() {
            let _ = self.flush_sends();
        }
        self.shared.stop();
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        if self.shared.failure().is_none() {
            self.shared.exit_barrier();
        }
    }
}
