//! The flight recorder: every rank keeps its last [`SLOTS`] communication operations (group,
//! kind, sequence number on that group, bytes, step, when it was queued on the communication
//! thread, start and end times) in a ring of
//! fixed-size text slots — in memory, or in a memory-mapped file `rank-NNNNN.flight` that
//! survives the process (a rank that is stopped, killed or hung still leaves its last
//! operations readable by the launcher on its node). [`Recorded`] wraps any [`Comm`] (local, tcp,
//! NCCL alike) and records every call; [`diagnose`] reads the ranks' records and says which ranks
//! wait in which operation and which rank never entered it.
//!
//! Sequence numbers count the collectives a rank called on a group (every member calls them in
//! the same order, so #k is the same operation on every member), and point-to-point messages per
//! peer and direction. With NCCL an operation ends when it is enqueued on the device stream.

mod diagnose;
mod slots;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use candle_core::{DType, Shape, Tensor};

use crate::comm::Result;

pub use diagnose::{diagnose, read_dir, Diagnosis};
pub use slots::{parse, OpRecord, RankRecord, SLOTS};

use super::{Channel, Comm, CommError, Group, HandOff, ReduceOp, Transfer};
use slots::Ring;

/// File name of rank `rank`'s record in a flight directory.
pub fn file_name(rank: usize) -> String {
    format!("rank-{rank:05}.flight")
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// What identifies a group across ranks in records: its member list, or for a large group its
/// size, first and last member and a hash of the list.
pub fn group_key(g: &Group) -> String {
    let r = g.ranks();
    if r.len() <= 24 {
        format!("{r:?}").replace(' ', "")
    } else {
        let h = r.iter().fold(0xcbf29ce484222325u64, |h, &x| {
            (h ^ x as u64).wrapping_mul(0x100000001b3)
        });
        format!("{}..{}/{}#{h:016x}", r[0], r[r.len() - 1], r.len())
    }
}

/// One rank's flight recorder.
pub struct FlightRecorder {
    rank: usize,
    ring: Mutex<Ring>,
    /// Calls per group key (collectives) or per `send:PEER` / `recv:PEER` (messages).
    seq: Mutex<HashMap<String, u64>>,
    step: AtomicU64,
    path: Option<PathBuf>,
}

/// An operation in flight: where its slot is, to complete it.
pub struct Started {
    slot: usize,
    record: OpRecord,
}

impl FlightRecorder {
    /// A recorder of rank `rank` of `world` keeping its last `slots` operations (at most
    /// [`SLOTS`]) in memory.
    pub fn in_memory(slots: usize, rank: usize, world: usize) -> Self {
        Self::with(rank, Ring::memory(slots, rank, world), None)
    }

    /// A recorder of rank `rank` of `world` keeping its last `slots` operations (at most
    /// [`SLOTS`]) in the file [`file_name`] under `dir` (created, replacing an earlier run's).
    pub fn in_dir(dir: &Path, slots: usize, rank: usize, world: usize) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(file_name(rank));
        let ring = Ring::file(&path, slots, rank, world)?;
        Ok(Self::with(rank, ring, Some(path)))
    }

    fn with(rank: usize, ring: Ring, path: Option<PathBuf>) -> Self {
        Self {
            rank,
            ring: Mutex::new(ring),
            seq: Mutex::new(HashMap::new()),
            step: AtomicU64::new(0),
            path,
        }
    }

    /// The rank recorded.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The file the record lives in, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Sets the training step later operations belong to.
    pub fn set_step(&self, step: u64) {
        self.step.store(step, Ordering::Relaxed);
    }

    /// Records the start of `op` on `key` (a group key, or `send:PEER` / `recv:PEER`).
    pub fn start(&self, op: &'static str, key: String, bytes: usize) -> Started {
        let seq = {
            let mut s = self.seq.lock().unwrap_or_else(|e| e.into_inner());
            let n = s.entry(key.clone()).or_insert(0);
            *n += 1;
            *n
        };
        let mut record = OpRecord {
            n: 0,
            seq,
            op: op.to_string(),
            key,
            bytes,
            step: self.step.load(Ordering::Relaxed),
            queued_ms: super::thread::queued_ms(),
            start_ms: now_ms(),
            end_ms: None,
            ok: None,
            failure: None,
        };
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let slot = ring.push(&mut record);
        Started { slot, record }
    }

    /// Records the end of an operation: successful, or failed as `failure` says (`timeout`,
    /// `peer`, `invalid`, `error`).
    pub fn end(&self, mut s: Started, failure: Option<&str>) {
        s.record.end_ms = Some(now_ms());
        s.record.ok = Some(failure.is_none());
        s.record.failure = failure.map(str::to_string);
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.write(s.slot, &s.record);
    }

    /// The record as it stands.
    pub fn snapshot(&self) -> RankRecord {
        self.ring.lock().unwrap_or_else(|e| e.into_inner()).read()
    }
}

/// A [`Comm`] whose every call is recorded by a [`FlightRecorder`].
pub struct Recorded {
    inner: Arc<dyn Comm>,
    recorder: Arc<FlightRecorder>,
}

impl Recorded {
    /// `inner`, recorded by `recorder`.
    pub fn new(inner: Arc<dyn Comm>, recorder: Arc<FlightRecorder>) -> Self {
        Self { inner, recorder }
    }

    /// The recorder.
    pub fn recorder(&self) -> &Arc<FlightRecorder> {
        &self.recorder
    }

    fn run<T>(
        &self,
        op: &'static str,
        key: String,
        bytes: usize,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let s = self.recorder.start(op, key, bytes);
        let out = f();
        let failure = out.as_ref().err().map(|e| match e {
            CommError::Timeout { .. } => "timeout",
            CommError::PeerFailed { .. } => "peer",
            CommError::Invalid { .. } => "invalid",
            CommError::Tensor(_) => "error",
        });
        self.recorder.end(s, failure);
        out
    }
}

fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl Comm for Recorded {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&self, group: &Group, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.run("all_reduce", group_key(group), bytes(t), || {
            self.inner.all_reduce(group, t, op)
        })
    }
    fn all_gather(&self, group: &Group, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.run("all_gather", group_key(group), bytes(t), || {
            self.inner.all_gather(group, t, dim)
        })
    }
    fn reduce_scatter(&self, group: &Group, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.run("reduce_scatter", group_key(group), bytes(t), || {
            self.inner.reduce_scatter(group, t, dim)
        })
    }
    fn broadcast(&self, group: &Group, t: &Tensor, root: usize) -> Result<Tensor> {
        self.run("broadcast", group_key(group), bytes(t), || {
            self.inner.broadcast(group, t, root)
        })
    }
    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        self.run("send", format!("send:{dst}"), bytes(t), || {
            self.inner.send(t, dst)
        })
    }
    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let n = shape.elem_count() * dtype.size_in_bytes();
        self.run("recv", format!("recv:{src}"), n, || {
            self.inner.recv(src, shape, dtype)
        })
    }
    fn barrier(&self, group: &Group) -> Result<()> {
        self.run("barrier", group_key(group), 0, || self.inner.barrier(group))
    }
    fn barrier_within(&self, group: &Group, timeout: std::time::Duration) -> Result<()> {
        self.run("barrier", group_key(group), 0, || {
            self.inner.barrier_within(group, timeout)
        })
    }
    /// Recorded as posted (the wait is the caller's).
    fn send_recv(&self, group: &Group, t: &Tensor, dst: usize, src: usize) -> Result<Transfer> {
        self.run("send_recv", group_key(group), bytes(t), || {
            self.inner.send_recv(group, t, dst, src)
        })
    }
    fn all_to_all(
        &self,
        group: &Group,
        t: &Tensor,
        send: &[usize],
        recv: &[usize],
    ) -> Result<Tensor> {
        self.run("all_to_all", group_key(group), bytes(t), || {
            self.inner.all_to_all(group, t, send, recv)
        })
    }
    fn hand_off(&self) -> Result<HandOff> {
        self.inner.hand_off()
    }
    fn all_reduce_in_place(
        &self,
        group: &Group,
        t: &Tensor,
        op: ReduceOp,
        after: &HandOff,
    ) -> Result<()> {
        self.run("all_reduce", group_key(group), bytes(t), || {
            self.inner.all_reduce_in_place(group, t, op, after)
        })
    }
    fn reduce_scatter_in_place(
        &self,
        group: &Group,
        t: &Tensor,
        after: &HandOff,
    ) -> Result<Tensor> {
        self.run("reduce_scatter", group_key(group), bytes(t), || {
            self.inner.reduce_scatter_in_place(group, t, after)
        })
    }
    fn all_gather_in_place(&self, group: &Group, t: &Tensor, after: &HandOff) -> Result<()> {
        // Recorded as the bytes this rank contributes, as an out-of-place all-gather is.
        let own = bytes(t) / group.size().max(1);
        self.run("all_gather", group_key(group), own, || {
            self.inner.all_gather_in_place(group, t, after)
        })
    }
    fn prepare(&self, channels: &[Channel]) -> Result<()> {
        self.inner.prepare(channels)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}
