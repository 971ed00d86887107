//! The shared state of one [`NcclComm`](super::NcclComm): its communicators (created lazily
//! through the store), the job's failure, bounded waits, pending operations and the watchdog thread.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::cuda::cudarc::driver::{CudaEvent, CudaStream};
use candle_core::cuda::CudaDevice;
use candle_core::Tensor;

use super::layout::{AbortKeys, CommKey, RendezvousKeys};
use super::raw::{new_unique_id, start_init, Fault, RawComm};
use crate::comm::CommError;
use crate::store::{Store, StoreError};

mod watch;

/// How often waits poll the job's failure record and NCCL's asynchronous errors, and the
/// watchdog wakes up.
pub(super) const SLOW_CHECK: Duration = Duration::from_millis(200);
/// The watchdog polls the store every [`SLOW_CHECK`] while an operation ran within this window.
const ACTIVE_WINDOW: Duration = Duration::from_secs(5);
/// How long a failing rank waits for its communicators' concurrent aborts before going on (an
/// abort stuck on a spinning kernel is left to the process's exit deadline).
const ABORT_DEADLINE: Duration = Duration::from_secs(10);
/// ... and this often otherwise, which also keeps the store connection from idling out (the
/// server drops a connection silent for 4 timeouts, at least 4 s).
const IDLE_POLL: Duration = Duration::from_secs(2);

/// How often an active rank of a job of `world` ranks polls rank 0's store for another rank's
/// abort: every [`SLOW_CHECK`] up to 64 ranks, less often beyond (at most [`IDLE_POLL`]), so that
/// rank 0's host serves a few hundred polls a second rather than one per rank every 200 ms
/// (5,000 a second at 1,024 ranks; 512 now).
pub(super) fn store_poll(world: usize) -> Duration {
    (SLOW_CHECK * (world / 64).max(1) as u32).min(IDLE_POLL)
}

/// Pacing of a wait: spin (yielding) for `spin`, then sleep from `first`, doubling up to `max`.
#[derive(Clone, Copy)]
pub(super) struct Pace {
    spin: Duration,
    first: Duration,
    max: Duration,
}

/// Waiting for the GPU: short collectives finish within the spin.
pub(super) const GPU: Pace = Pace {
    spin: Duration::from_millis(1),
    first: Duration::from_micros(20),
    max: Duration::from_millis(1),
};
/// Waiting on the store or a communicator's initialisation: gentle on the store server.
pub(super) const SLOW: Pace = Pace {
    spin: Duration::ZERO,
    first: Duration::from_millis(2),
    max: Duration::from_millis(50),
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The caller, operation and ranks of one call, for building its errors.
pub(super) struct Call {
    pub me: usize,
    pub op: &'static str,
    pub group: Vec<usize>,
    /// The ranks to name if the call times out.
    pub missing: Vec<usize>,
}

impl Call {
    pub(super) fn invalid(&self, message: String) -> CommError {
        let (me, op, group) = (self.me, self.op, self.group.clone());
        CommError::Invalid {
            me,
            op,
            group,
            message,
        }
    }

    pub(super) fn peer_failed(&self, failed: usize, reason: String) -> CommError {
        let (me, op, group) = (self.me, self.op, self.group.clone());
        CommError::PeerFailed {
            me,
            op,
            group,
            failed,
            reason,
        }
    }

    fn timeout(&self, after: Duration, missing: Vec<usize>) -> CommError {
        let (me, op, group) = (self.me, self.op, self.group.clone());
        let secs = after.as_secs_f64();
        CommError::Timeout {
            me,
            op,
            group,
            secs,
            missing,
        }
    }
}

/// An operation enqueued on a communicator's stream whose completion no host thread waits for:
/// a send, or a stream-ordered collective or receive (the device stream waits for it instead).
/// Reaped once complete; the watchdog and every later call fail the job if one outlives the
/// timeout or its communicator reports an asynchronous error.
pub(super) struct PendingOp {
    pub done: CudaEvent,
    /// Kept alive (never read) until `done`: a send's copy, a grouped transfer's buffers.
    pub _data: Vec<Tensor>,
    /// Its communicator's key (for NCCL's asynchronous errors; holding the communicator itself
    /// would keep it from being aborted before the pending operations go).
    pub key: CommKey,
    /// `send`, `all_reduce`, …
    pub op: &'static str,
    /// Its group: the members of a collective, the two ranks of a transfer.
    pub group: Vec<usize>,
    /// The peers it needs: the other members, or the destination of a send.
    pub peers: Vec<usize>,
    pub since: Instant,
}

impl PendingOp {
    fn what(&self) -> String {
        match (self.op, self.peers.as_slice()) {
            ("send", [dst]) => format!("send to rank {dst}"),
            (op, _) => format!("{op} on ranks {:?}", self.group),
        }
    }
}

/// A pending operation that failed or outlived the timeout.
pub(super) struct OpFault {
    pub op: &'static str,
    pub group: Vec<usize>,
    pub peers: Vec<usize>,
    pub reason: String,
    pub timed_out: bool,
}

/// State shared by the calling threads and the watchdog. Field order is drop order:
/// communicators are aborted (and their streams destroyed) before pending operations go.
pub(super) struct Shared {
    pub rank: usize,
    pub world_size: usize,
    pub timeout: Duration,
    /// Store key prefix of this `NcclComm` instance.
    pub prefix: String,
    pub device: CudaDevice,
    pub stream: Arc<CudaStream>,
    pub comms: Mutex<HashMap<CommKey, Arc<RawComm>>>,
    /// Serialises communicator creation on this rank.
    creating: Mutex<()>,
    pub pending: Mutex<VecDeque<PendingOp>>,
    store: Mutex<Store>,
    failure: Mutex<Option<(usize, String)>>,
    failed: AtomicBool,
    /// NCCL host calls in progress: id -> (start, op).
    host_calls: Mutex<HashMap<u64, (Instant, &'static str)>>,
    next_call: AtomicU64,
    epoch: Instant,
    last_active_ms: AtomicU64,
    stop: Mutex<bool>,
    stop_cv: Condvar,
}

impl Shared {
    pub(super) fn new(
        rank: usize,
        world_size: usize,
        timeout: Duration,
        prefix: String,
        device: CudaDevice,
        store: Store,
    ) -> Self {
        let stream = device.cuda_stream();
        Self {
            rank,
            world_size,
            timeout,
            prefix,
            device,
            stream,
            comms: Mutex::new(HashMap::new()),
            creating: Mutex::new(()),
            pending: Mutex::new(VecDeque::new()),
            store: Mutex::new(store),
            failure: Mutex::new(None),
            failed: AtomicBool::new(false),
            host_calls: Mutex::new(HashMap::new()),
            next_call: AtomicU64::new(0),
            epoch: Instant::now(),
            last_active_ms: AtomicU64::new(0),
            stop: Mutex::new(false),
            stop_cv: Condvar::new(),
        }
    }

    /// The first failure this rank knows of: the failed rank and its reason.
    pub(super) fn failure(&self) -> Option<(usize, String)> {
        if !self.failed.load(Ordering::SeqCst) {
            return None;
        }
        lock(&self.failure).clone()
    }

    /// Records a failure (the first one is kept) and aborts every communicator of this rank, so
    /// that pending operations end and later ones fail.
    pub(super) fn fail(&self, rank: usize, reason: String) {
        let (failed, reason) = lock(&self.failure).get_or_insert((rank, reason)).clone();
        self.failed.store(true, Ordering::SeqCst);
        crate::comm::failure::report(failed, &reason);
        // All at once: an abort can wait on a kernel spinning for a peer, and one after another
        // those waits would add up. Aborts still running at the deadline are left to the
        // process's exit deadline.
        let comms: Vec<_> = lock(&self.comms).values().cloned().collect();
        let aborts: Vec<_> = comms
            .into_iter()
            .map(|c| std::thread::spawn(move || c.abort()))
            .collect();
        let deadline = std::time::Instant::now() + ABORT_DEADLINE;
        for a in aborts {
            while !a.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            if a.is_finished() {
                let _ = a.join();
            }
        }
    }

    /// The job's failure as an error of `call`, if any.
    pub(super) fn check(&self, call: &Call) -> Result<(), CommError> {
        match self.failure() {
            Some((failed, reason)) => Err(call.peer_failed(failed, reason)),
            None => Ok(()),
        }
    }

    /// Marks this rank as communicating now (the watchdog polls the store while it is).
    pub(super) fn touch(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.last_active_ms.store(ms, Ordering::Relaxed);
    }

    /// Time since this rank last communicated.
    fn idle(&self) -> Duration {
        let now_ms = self.epoch.elapsed().as_millis() as u64;
        Duration::from_millis(now_ms.saturating_sub(self.last_active_ms.load(Ordering::Relaxed)))
    }

    /// Starts an operation: if the watchdog has not been polling the store (this rank was idle),
    /// reads the failure record first, so that an abort during the idle time fails this call.
    pub(super) fn resume(&self, call: &Call) -> Result<(), CommError> {
        if self.failure().is_none() && self.idle() >= ACTIVE_WINDOW {
            if let Some((rank, reason)) = self.poll_store() {
                self.fail(rank, reason);
            }
        }
        self.touch();
        self.check(call)
    }

    /// Runs an NCCL host call (its launch and settling), registered so that the watchdog fails
    /// the job, aborting the communicators, if it outlives the timeout.
    pub(super) fn host_call<R>(&self, op: &'static str, f: impl FnOnce() -> R) -> R {
        let id = self.next_call.fetch_add(1, Ordering::Relaxed);
        lock(&self.host_calls).insert(id, (Instant::now(), op));
        let out = f();
        lock(&self.host_calls).remove(&id);
        out
    }

    /// Runs a store request; an unreachable store fails the job (it is served by rank 0).
    pub(super) fn store_op<T>(
        &self,
        call: &Call,
        f: impl FnOnce(&mut Store) -> Result<T, StoreError>,
    ) -> Result<T, CommError> {
        let out = f(&mut lock(&self.store));
        out.map_err(|e| {
            let reason = format!("rendezvous store unreachable: {e}");
            self.fail(0, reason.clone());
            call.peer_failed(0, reason)
        })
    }

    /// Polls `ready` until it yields a value, the job fails, or `deadline` passes (then the
    /// failure is recorded, every communicator aborted, and `call` times out naming
    /// `call.missing`). `ready` is told when a slow check (every [`SLOW_CHECK`]) is due.
    pub(super) fn poll<T>(
        &self,
        call: &Call,
        deadline: Instant,
        pace: Pace,
        ready: impl FnMut(bool) -> Result<Option<T>, CommError>,
    ) -> Result<T, CommError> {
        self.poll_within(call, (deadline, self.timeout), pace, ready)
    }

    /// [`Shared::poll`] whose deadline stands for a wait of `after` (named by its timeout).
    pub(super) fn poll_within<T>(
        &self,
        call: &Call,
        (deadline, after): (Instant, Duration),
        pace: Pace,
        mut ready: impl FnMut(bool) -> Result<Option<T>, CommError>,
    ) -> Result<T, CommError> {
        let start = Instant::now();
        let (mut pause, mut next_slow) = (pace.first, start + SLOW_CHECK);
        loop {
            let now = Instant::now();
            let slow = now >= next_slow;
            if slow {
                next_slow = now + SLOW_CHECK;
                self.touch();
            }
            if let Some(v) = ready(slow)? {
                return Ok(v);
            }
            self.check(call)?;
            if now >= deadline {
                let e = call.timeout(after, call.missing.clone());
                self.fail(self.rank, e.to_string());
                return Err(e);
            }
            if now - start < pace.spin {
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause.min(deadline - now));
                pause = (pause * 2).min(pace.max);
            }
        }
    }

    /// Waits until the GPU has passed `done` (recorded after an operation on `comm`), up to
    /// `timeout`.
    pub(super) fn wait_event(
        &self,
        call: &Call,
        done: &CudaEvent,
        comm: &RawComm,
        timeout: Duration,
    ) -> Result<(), CommError> {
        let me = self.rank;
        let deadline = Instant::now() + timeout;
        self.poll_within(call, (deadline, timeout), GPU, |slow| {
            let failed = |reason: String| {
                self.fail(me, reason.clone());
                let (failed, reason) = self.failure().unwrap_or((me, reason));
                Err(call.peer_failed(failed, reason))
            };
            match done.try_is_complete() {
                // An aborted communicator's operation completes without a valid result.
                Ok(true) if comm.is_aborted() => failed("NCCL communicator aborted".into()),
                Ok(true) => Ok(Some(())),
                Ok(false) if slow => match comm.async_error() {
                    Some(e) => failed(format!("NCCL error in {}: {e}", call.op)),
                    None => Ok(None),
                },
                Ok(false) => Ok(None),
                Err(e) => failed(format!("CUDA error in {}: {e}", call.op)),
            }
        })
    }

    /// This rank's communicator for `key`, created on first use: member 0 publishes a fresh NCCL
    /// id, every member announces itself, waits (bounded) for all the others, then joins.
    pub(super) fn comm(&self, call: &Call, key: &CommKey) -> Result<Arc<RawComm>, CommError> {
        if let Some(c) = lock(&self.comms).get(key) {
            return Ok(c.clone());
        }
        let _creating = lock(&self.creating);
        if let Some(c) = lock(&self.comms).get(key) {
            return Ok(c.clone());
        }
        let deadline = Instant::now() + self.timeout;
        let members = key.members();
        let (size, me) = (members.len(), self.rank);
        let index = members.iter().position(|&r| r == me).unwrap_or(0);
        let base = key.store_base(&self.prefix);
        let keys = RendezvousKeys::new(&base);
        let nccl_failed = |what: &str, message: String| {
            let reason = format!("NCCL {what} for {key:?} failed: {message}");
            self.fail(me, reason.clone());
            call.peer_failed(me, reason)
        };
        if index == 0 {
            let id = new_unique_id().map_err(|m| nccl_failed("unique id", m))?;
            self.store_op(call, |s| s.set(&keys.id, &id))?;
        }
        self.store_op(call, |s| {
            s.add(&RendezvousKeys::here(&base, me), 1)?;
            s.add(&keys.count, 1)
        })?;
        self.touch();
        let arrived = self.poll(call, deadline, SLOW, |_| {
            let n = self.store_op(call, |s| s.add(&keys.count, 0))?;
            Ok((n as usize >= size).then_some(()))
        });
        if let Err(CommError::Timeout { .. }) = arrived {
            // Name the members that never arrived, rather than the whole group.
            let absent = |&r: &usize| {
                let n = self.store_op(call, |s| s.add(&RendezvousKeys::here(&base, r), 0));
                n.map_or(true, |n| n == 0)
            };
            let missing = members.iter().copied().filter(absent).collect();
            return Err(call.timeout(self.timeout, missing));
        }
        arrived?;
        let id = self.store_op(call, |s| s.get(&keys.id))?;
        let id = <[u8; 128]>::try_from(id.as_slice())
            .map_err(|_| call.invalid(format!("malformed NCCL id of {key:?} in the store")))?;
        // Non-blocking: NCCL initialises the communicator on a thread of its own while this
        // one polls, so the wait is bounded and a timeout or a peer's failure ends it; the
        // half-made communicator is then abandoned.
        let comm = start_init(self.stream.context(), id, index, size)
            .map_err(|m| nccl_failed("init", m))?;
        let ready = self.poll(call, deadline, SLOW, |_| match comm.ready() {
            Ok(true) => Ok(Some(Ok(()))),
            Ok(false) => Ok(None),
            Err(fault) => Ok(Some(Err(fault))),
        });
        let failed = match ready {
            Ok(Ok(())) => None,
            Ok(Err(Fault::Failed { message, .. })) => Some(nccl_failed("init", message)),
            Ok(Err(Fault::Aborted)) => Some(nccl_failed("init", "communicator aborted".into())),
            Err(e) => Some(e),
        };
        if let Some(e) = failed {
            abandon(comm);
            return Err(e);
        }
        let comm = Arc::new(comm);
        let mut comms = lock(&self.comms);
        if let Some((failed, reason)) = self.failure() {
            drop(comms);
            comm.abort();
            return Err(call.peer_failed(failed, reason));
        }
        comms.insert(key.clone(), comm.clone());
        Ok(comm)
    }
}

/// Aborts a communicator whose creation failed, on a thread of its own: the abort of one still
/// initialising waits for NCCL's initialisation thread, without a deadline (the process's exit
/// deadline bounds it), and the caller holds the creation lock. Without a thread, here.
fn abandon(comm: RawComm) {
    let _ = std::thread::Builder::new()
        .name("nccl-abandon".into())
        .spawn(move || drop(comm));
}
