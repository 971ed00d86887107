//! Backend `tcp`: the ranks are processes (one per CPU rank, on one or several hosts) connected
//! pairwise over TCP — the CPU counterpart of NCCL for jobs started by `--nproc-per-node`,
//! torchrun or Slurm. Defines [`TcpComm`].
//!
//! # Design
//!
//! - **Setup.** Every rank listens on an ephemeral port of the interface that reaches the
//!   rendezvous store, publishes `host:port` in the store, connects to every lower rank and accepts
//!   every higher one. A connection starts with a `Hello` frame carrying the job's token and the
//!   sender's rank; anything else is dropped, so stray connections cannot join.
//! - **Matching.** Each member counts its calls on a group; the `n`-th call of every member has
//!   sequence number `n`. A collective's frames are keyed by `(sender, group id, n)`; a point-to-
//!   point message by `(sender, 0, k)` for the sender's `k`-th message to this rank. One reader
//!   thread per peer files incoming frames in the inbox.
//! - **Identical results.** Every member sends its contribution to every other member (the
//!   broadcast root only sends), then computes the result from all contributions in member order
//!   with the same code as the `local` backend, so results are bit-identical on every member and
//!   to a thread-rank run. Traffic is `O(members²)` per collective: meant for CPU jobs.
//! - **Failure.** [`Comm::abort`] sends an `Abort` frame to every peer; a lost connection
//!   without an orderly `Bye` is a failure of that peer; a peer that said `Bye` and is still
//!   awaited fails the call. Pending and later calls return [`CommError::PeerFailed`]; waits end
//!   with [`CommError::Timeout`] naming the ranks whose frames never came.

mod exchange;
mod handshake;
mod wire;

use std::collections::{HashMap, HashSet};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::{DType, Error, Shape, Tensor};

use crate::comm::Result;

use super::collective::Kind;
use super::{check_send_recv, Comm, CommError, Group, ReduceOp, Transfer};
use crate::store::Store;
use handshake::{accept_higher, connect_until};
use wire::{decode, encode, read_frame, signature, write_frame, FrameKind};

/// Inbox key: `(sender, group id, sequence number)`.
type Key = (usize, u64, u64);

/// What the reader threads have received, and the job's failure.
#[derive(Default)]
struct Inbox {
    frames: HashMap<Key, (u8, Vec<u8>)>,
    /// The first failure seen: `(failed rank, reason)`.
    failure: Option<(usize, String)>,
    /// Peers that closed their connection in an orderly way.
    departed: HashSet<usize>,
    /// This rank is shutting down: lost connections are expected.
    closing: bool,
}

struct Shared {
    inbox: Mutex<Inbox>,
    cv: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One rank's communicator over TCP connections to every other rank of the job.
pub struct TcpComm {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// Write halves, indexed by peer rank (`None` for this rank).
    writers: Vec<Option<Mutex<TcpStream>>>,
    shared: Arc<Shared>,
    /// Calls made per group.
    seqs: Mutex<HashMap<Group, u64>>,
    /// Messages sent to / received from each rank.
    sent: Mutex<Vec<u64>>,
    received: Mutex<Vec<u64>>,
    /// The reader threads (detached on drop).
    readers: Mutex<Vec<JoinHandle<()>>>,
}

/// A stable non-zero id of a group (FNV-1a over its ranks).
fn group_id(group: &Group) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &r in group.ranks() {
        for b in (r as u64).to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h.max(1)
}

/// Operation code and the parameter every member must agree on.
fn code(kind: Kind) -> (u8, u64) {
    match kind {
        Kind::AllReduce(ReduceOp::Sum) => (1, 0),
        Kind::AllReduce(ReduceOp::Max) => (2, 0),
        Kind::AllGather(dim) => (3, dim as u64),
        Kind::ReduceScatter(dim) => (4, dim as u64),
        Kind::Broadcast(root) => (5, root as u64),
        Kind::Barrier => (6, 0),
    }
}

impl TcpComm {
    /// Joins the job as `rank` of `world_size`: publishes this rank's listening address in
    /// `store`, connects to every other rank (presenting `token`) and starts the readers. Every
    /// rank of the job must call it; gives up after `timeout`, naming the ranks that never came.
    pub fn connect(
        rank: usize,
        world_size: usize,
        store: &mut Store,
        token: &str,
        timeout: Duration,
    ) -> candle_core::Result<Arc<Self>> {
        let fail = |m: String| Error::msg(format!("rank {rank}: tcp backend: {m}"));
        let host = store.local_addr().map_err(|e| fail(e.to_string()))?.ip();
        let listener = TcpListener::bind(SocketAddr::new(host, 0))
            .map_err(|e| fail(format!("cannot listen on {host}: {e}")))?;
        let me = listener.local_addr().map_err(|e| fail(e.to_string()))?;
        store
            .set(&format!("tcp/{rank}"), me.to_string().as_bytes())
            .map_err(|e| fail(e.to_string()))?;
        let deadline = Instant::now() + timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
            let addr = store
                .get(&format!("tcp/{peer}"))
                .map_err(|e| fail(e.to_string()))?;
            let addr = String::from_utf8_lossy(&addr).to_string();
            let mut s = connect_until(&addr, deadline)
                .map_err(|e| fail(format!("cannot connect to rank {peer} at {addr}: {e}")))?;
            write_frame(
                &mut s,
                FrameKind::Hello,
                0,
                0,
                rank as u64,
                token.as_bytes(),
            )
            .map_err(|e| fail(format!("greeting rank {peer}: {e}")))?;
            *slot = Some(s);
        }
        accept_higher(&listener, rank, token, deadline, &mut streams).map_err(fail)?;
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox::default()),
            cv: Condvar::new(),
        });
        let mut writers = Vec::with_capacity(world_size);
        let mut readers = Vec::new();
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                writers.push(None);
                continue;
            };
            s.set_nodelay(true).map_err(|e| fail(e.to_string()))?;
            // A peer that is alive but stops reading must not block this rank forever.
            s.set_write_timeout(Some(timeout))
                .map_err(|e| fail(e.to_string()))?;
            s.set_read_timeout(None).map_err(|e| fail(e.to_string()))?;
            let read_half = s.try_clone().map_err(|e| fail(e.to_string()))?;
            let shared = shared.clone();
            let reader = std::thread::Builder::new()
                .name(format!("tcp-recv-{peer}"))
                .spawn(move || read_loop(peer, read_half, &shared))
                .map_err(|e| fail(format!("cannot start the reader of rank {peer}: {e}")))?;
            readers.push(reader);
            writers.push(Some(Mutex::new(s)));
        }
        Ok(Arc::new(Self {
            rank,
            world_size,
            timeout,
            writers,
            shared,
            seqs: Mutex::new(HashMap::new()),
            sent: Mutex::new(vec![0; world_size]),
            received: Mutex::new(vec![0; world_size]),
            readers: Mutex::new(readers),
        }))
    }

    fn err(
        &self,
        op: &'static str,
        group: &[usize],
        e: impl Fn(usize, &'static str, Vec<usize>) -> CommError,
    ) -> CommError {
        e(self.rank, op, group.to_vec())
    }

    fn invalid(&self, op: &'static str, group: &[usize], message: String) -> CommError {
        self.err(op, group, |me, op, group| CommError::Invalid {
            me,
            op,
            group,
            message: message.clone(),
        })
    }

    /// Sends one frame to `peer`; a write failure is that peer's failure.
    fn send_frame(
        &self,
        op: &'static str,
        group: &[usize],
        peer: usize,
        frame: (FrameKind, u8, u64, u64),
        payload: &[u8],
    ) -> Result<()> {
        let Some(Some(w)) = self.writers.get(peer) else {
            return Err(self.invalid(op, group, format!("no connection to rank {peer}")));
        };
        if let Some((failed, reason)) = lock(&self.shared.inbox).failure.clone() {
            return Err(self.err(op, group, |me, op, group| CommError::PeerFailed {
                me,
                op,
                group,
                failed,
                reason: reason.clone(),
            }));
        }
        let (kind, code, gid, seq) = frame;
        let written = write_frame(&mut *lock(w), kind, code, gid, seq, payload);
        written.map_err(|e| {
            // Recorded and reported as the reader records a lost connection (unless a failure is
            // known already): a write can notice the peer's end before its reader does, and the
            // job's failure must still be the peer's, not this rank's own.
            let (failed, reason) = {
                let mut inbox = lock(&self.shared.inbox);
                let lost = (peer, format!("connection lost while sending: {e}"));
                inbox.failure.get_or_insert(lost).clone()
            };
            super::failure::report(failed, &reason);
            self.shared.cv.notify_all();
            self.err(op, group, |me, op, group| CommError::PeerFailed {
                me,
                op,
                group,
                failed,
                reason: reason.clone(),
            })
        })
    }
}

/// Files every frame from `peer` in the inbox until the connection ends.
fn read_loop(peer: usize, mut stream: TcpStream, shared: &Shared) {
    loop {
        let frame = read_frame(&mut stream);
        let mut inbox = lock(&shared.inbox);
        match frame {
            Ok(f) if f.kind == FrameKind::Data => {
                inbox
                    .frames
                    .insert((peer, f.group, f.seq), (f.op, f.payload));
            }
            Ok(f) if f.kind == FrameKind::Abort => {
                let reason = String::from_utf8_lossy(&f.payload).to_string();
                let (failed, reason) = inbox.failure.get_or_insert((f.seq as usize, reason));
                super::failure::report(*failed, reason);
            }
            Ok(f) if f.kind == FrameKind::Bye => {
                inbox.departed.insert(peer);
                shared.cv.notify_all();
                return;
            }
            Ok(f) => {
                let reason = format!("protocol error: unexpected {:?} frame", f.kind);
                let (failed, reason) = inbox.failure.get_or_insert((peer, reason));
                super::failure::report(*failed, reason);
            }
            Err(e) => {
                if !inbox.closing && !inbox.departed.contains(&peer) {
                    let (failed, reason) = inbox
                        .failure
                        .get_or_insert((peer, format!("connection lost: {e}")));
                    super::failure::report(*failed, reason);
                }
                shared.cv.notify_all();
                return;
            }
        }
        shared.cv.notify_all();
    }
}

impl Comm for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, group: &Group, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.tensor_op(group, Kind::AllReduce(op), t)
    }

    fn all_gather(&self, group: &Group, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.tensor_op(group, Kind::AllGather(dim), t)
    }

    fn reduce_scatter(&self, group: &Group, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.tensor_op(group, Kind::ReduceScatter(dim), t)
    }

    fn broadcast(&self, group: &Group, t: &Tensor, root: usize) -> Result<Tensor> {
        self.tensor_op(group, Kind::Broadcast(root), t)
    }

    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        let ranks = [self.rank, dst];
        let seq = {
            let mut sent = lock(&self.sent);
            let Some(n) = sent.get_mut(dst).filter(|_| dst != self.rank) else {
                return Err(self.invalid("send", &ranks, format!("invalid destination {dst}")));
            };
            *n += 1;
            *n
        };
        self.send_frame(
            "send",
            &ranks,
            dst,
            (FrameKind::Data, 0, 0, seq),
            &encode(&t.detach())?,
        )
    }

    /// A `send`, then a `recv`: sends never wait for their receiver here.
    fn send_recv(&self, group: &Group, t: &Tensor, dst: usize, src: usize) -> Result<Transfer> {
        check_send_recv(self.rank, group, dst, src)?;
        self.send(t, dst)?;
        Ok(Transfer::ready(self.recv(src, t.shape(), t.dtype())?))
    }

    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let ranks = [src, self.rank];
        let seq = {
            let mut received = lock(&self.received);
            let Some(n) = received.get_mut(src).filter(|_| src != self.rank) else {
                return Err(self.invalid("recv", &ranks, format!("invalid source {src}")));
            };
            *n += 1;
            *n
        };
        let got = self.wait("recv", &ranks, &[(src, 0, seq)])?;
        let payload = &got[0].1;
        match signature(payload) {
            Some((d, s, _)) if d == dtype && &s == shape => {
                Ok(decode(payload, &candle_core::Device::Cpu)?)
            }
            other => Err(self.invalid(
                "recv",
                &ranks,
                format!(
                    "expected {shape:?} {dtype:?}, rank {src} sent {:?}",
                    other.map(|(d, s, _)| (s, d))
                ),
            )),
        }
    }

    fn barrier(&self, group: &Group) -> Result<()> {
        self.collective(group, Kind::Barrier, None).map(|_| ())
    }

    fn barrier_within(&self, group: &Group, timeout: Duration) -> Result<()> {
        self.collective_within(group, Kind::Barrier, None, timeout)
            .map(|_| ())
    }

    /// Records the job's failure (this rank's, unless a failure is already known) and forwards
    /// the recorded one to every peer, so the rank that failed first is the one every rank names.
    fn abort(&self, reason: &str) {
        let (failed, reason) = {
            let mut inbox = lock(&self.shared.inbox);
            inbox
                .failure
                .get_or_insert((self.rank, reason.to_string()))
                .clone()
        };
        super::failure::report(failed, &reason);
        self.shared.cv.notify_all();
        for w in self.writers.iter().flatten() {
            let _ = write_frame(
                &mut *lock(w),
                FrameKind::Abort,
                0,
                0,
                failed as u64,
                reason.as_bytes(),
            );
        }
    }
}

impl Drop for TcpComm {
    /// Says `Bye` to every peer and closes the sending halves. The readers keep draining until
    /// each peer closes in turn (never leaving unread data that would reset a connection) and
    /// then end on their own.
    fn drop(&mut self) {
        lock(&self.shared.inbox).closing = true;
        for w in self.writers.iter().flatten() {
            let mut s = lock(w);
            let _ = write_frame(&mut *s, FrameKind::Bye, 0, 0, 0, &[]);
            let _ = s.shutdown(Shutdown::Write);
        }
        lock(&self.readers).clear();
    }
}
