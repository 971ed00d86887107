//! Backend `local`: the ranks are threads of one process. Defines [`LocalWorld`] (the shared
//! state of one job), [`LocalComm`] (one rank's [`Comm`]: collectives through the `rendezvous`
//! submodule, send/recv through per-destination mailboxes) and [`run_local`] (a job's ranks as
//! threads, submodule `threads`).
//!
//! # Design
//!
//! - **Matching.** Each group has its own state (a mutex and a condition variable), so threads
//!   of one rank may use different groups concurrently. Every member counts its own calls on a
//!   group; the `n`-th call of every member lands in the same *slot*. The first arrival records
//!   the operation, its parameters and the tensor's shape, dtype and device; a member arriving with
//!   anything different fails the slot with [`CommError::Invalid`] for all members.
//! - **Identical results.** The last member to arrive computes the result once, outside the
//!   lock, with candle ops on the tensors' own device (sums as `((c0 + c1) + c2) + …` in member
//!   order), and every member gets a handle to that one result. Results are fresh tensors (never
//!   an alias of an input), detached from the autograd graph, and may share storage between
//!   members: don't mutate them in place (`slice_set`, `zero_set`).
//! - **Failure.** [`Comm::abort`] records the first failure of the job and wakes every waiter;
//!   pending and later calls return [`CommError::PeerFailed`]. A wait that outlives the timeout
//!   fails the slot with [`CommError::Timeout`] naming the members that never arrived.
//! - **Memory.** A slot is removed once each member has collected its outcome.
//!
//! Errors reach callers as candle errors holding the [`CommError`] (see [`CommError::find`]; its
//! message names the calling rank, the operation, the group and the failed or missing ranks).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use candle_core::{DType, Error, Result, Shape, Tensor};

use super::collective::{fresh, Kind};
use super::{Comm, CommError, Group, ReduceOp};
use rendezvous::GroupState;

mod rendezvous;
mod threads;

pub use threads::{run_local, RankFailed, ThreadError};

/// Messages to one rank, one FIFO per sender.
struct Mailbox {
    queues: Mutex<Vec<VecDeque<Tensor>>>,
    cv: Condvar,
}

/// Locks a mutex, recovering the data if a panicking thread poisoned it (the state stays
/// consistent: no code here panics while holding a lock).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The shared state of one job whose ranks are threads of this process.
pub struct LocalWorld {
    world_size: usize,
    timeout: Duration,
    /// The first failed rank and its reason.
    failure: OnceLock<(usize, String)>,
    groups: Mutex<HashMap<Group, Arc<GroupState>>>,
    /// Indexed by destination rank.
    mailboxes: Vec<Mailbox>,
}

impl LocalWorld {
    /// One communicator per rank (index = rank), sharing state; every wait gives up after
    /// `timeout`.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world_size: usize, timeout: Duration) -> Vec<Arc<LocalComm>> {
        let world = Arc::new(LocalWorld {
            world_size,
            timeout,
            failure: OnceLock::new(),
            groups: Mutex::new(HashMap::new()),
            mailboxes: (0..world_size)
                .map(|_| Mailbox {
                    queues: Mutex::new(vec![VecDeque::new(); world_size]),
                    cv: Condvar::new(),
                })
                .collect(),
        });
        (0..world_size)
            .map(|rank| {
                Arc::new(LocalComm {
                    rank,
                    world: world.clone(),
                })
            })
            .collect()
    }

    fn group_state(&self, group: &Group) -> Arc<GroupState> {
        let mut groups = lock(&self.groups);
        let state = groups.entry(group.clone());
        state
            .or_insert_with(|| Arc::new(GroupState::new(group.size())))
            .clone()
    }
}

/// One rank's communicator in a [`LocalWorld`].
pub struct LocalComm {
    rank: usize,
    world: Arc<LocalWorld>,
}

/// The caller, operation and ranks of one call, for building its errors.
struct Call<'a> {
    me: usize,
    op: &'static str,
    group: &'a [usize],
    world: &'a LocalWorld,
}

impl Call<'_> {
    fn invalid(&self, message: String) -> CommError {
        let (me, op, group) = (self.me, self.op, self.group.to_vec());
        CommError::Invalid {
            me,
            op,
            group,
            message,
        }
    }

    fn timeout(&self, missing: Vec<usize>) -> CommError {
        let (me, op, group) = (self.me, self.op, self.group.to_vec());
        let secs = self.world.timeout.as_secs_f64();
        CommError::Timeout {
            me,
            op,
            group,
            secs,
            missing,
        }
    }

    /// The job's failure as seen by this call, if any rank has aborted.
    fn peer_failed(&self) -> Option<CommError> {
        let (failed, reason) = self.world.failure.get()?;
        let (me, op, group) = (self.me, self.op, self.group.to_vec());
        let (failed, reason) = (*failed, reason.clone());
        Some(CommError::PeerFailed {
            me,
            op,
            group,
            failed,
            reason,
        })
    }
}

/// Waits on `cv` until notified or `deadline`; `None` once the deadline has passed.
fn wait_until<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    deadline: Instant,
) -> Option<MutexGuard<'a, T>> {
    let left = deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())?;
    Some(
        cv.wait_timeout(guard, left)
            .unwrap_or_else(|e| e.into_inner())
            .0,
    )
}

impl LocalComm {
    /// The first failure recorded by [`Comm::abort`] in this job: the rank and its reason.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.world.failure.get().cloned()
    }

    /// Collective slots currently alive in the whole job (0 when every collective has been
    /// collected by all of its members). For leak tests.
    #[doc(hidden)]
    pub fn pending_slots(&self) -> usize {
        let groups: Vec<_> = lock(&self.world.groups).values().cloned().collect();
        groups.iter().map(|g| g.pending()).sum()
    }

    /// Point-to-point messages sent but not yet received in the whole job. For leak tests.
    #[doc(hidden)]
    pub fn pending_messages(&self) -> usize {
        let count = |m: &Mailbox| lock(&m.queues).iter().map(VecDeque::len).sum::<usize>();
        self.world.mailboxes.iter().map(count).sum()
    }

    fn call<'a>(&'a self, op: &'static str, group: &'a [usize]) -> Call<'a> {
        Call {
            me: self.rank,
            op,
            group,
            world: &self.world,
        }
    }

    /// Runs a collective that returns a tensor.
    fn tensor_op(&self, group: &Group, kind: Kind, t: &Tensor) -> Result<Tensor> {
        match self.collective(group, kind, Some(t)).map_err(Error::from)? {
            Some(t) => Ok(t),
            None => Err(Error::msg(format!("{}: internal: no result", kind.name()))),
        }
    }

    /// Runs one collective; returns this member's result (`None` for a barrier).
    fn collective(
        &self,
        group: &Group,
        kind: Kind,
        t: Option<&Tensor>,
    ) -> std::result::Result<Option<Tensor>, CommError> {
        let call = self.call(kind.name(), group.ranks());
        let Some(me) = group.index_of(self.rank) else {
            return Err(call.invalid(format!("rank {} is not a member of the group", self.rank)));
        };
        if let Some(&r) = group
            .ranks()
            .last()
            .filter(|&&r| r >= self.world.world_size)
        {
            let n = self.world.world_size;
            return Err(call.invalid(format!("no rank {r} in a job of {n} ranks")));
        }
        if let Some(e) = call.peer_failed() {
            return Err(e);
        }
        let deadline = Instant::now() + self.world.timeout;
        self.world
            .group_state(group)
            .run(&call, group, me, kind, t, deadline)
    }
}

impl Comm for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world.world_size
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

    fn barrier(&self, group: &Group) -> Result<()> {
        let out = self.collective(group, Kind::Barrier, None);
        out.map(|_| ()).map_err(Error::from)
    }

    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        let pair = [self.rank, dst];
        let call = self.call("send", &pair);
        let Some(mailbox) = self.world.mailboxes.get(dst) else {
            let n = self.world.world_size;
            return Err(Error::from(
                call.invalid(format!("no rank {dst} in a job of {n} ranks")),
            ));
        };
        if let Some(e) = call.peer_failed() {
            return Err(Error::from(e));
        }
        // A copy, so that later in-place updates of `t` by the sender are not seen by `dst`.
        let t = fresh(&t.detach())?;
        lock(&mailbox.queues)[self.rank].push_back(t);
        mailbox.cv.notify_all();
        Ok(())
    }

    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let pair = [src, self.rank];
        let call = self.call("recv", &pair);
        if src >= self.world.world_size {
            let n = self.world.world_size;
            return Err(Error::from(
                call.invalid(format!("no rank {src} in a job of {n} ranks")),
            ));
        }
        let deadline = Instant::now() + self.world.timeout;
        let mailbox = &self.world.mailboxes[self.rank];
        let mut queues = lock(&mailbox.queues);
        loop {
            if let Some(t) = queues[src].pop_front() {
                if t.shape() == shape && t.dtype() == dtype {
                    return Ok(t);
                }
                let (got, got_dtype) = (t.shape(), t.dtype());
                let msg = format!(
                    "expected {shape:?} {dtype:?} from rank {src}, got {got:?} {got_dtype:?}"
                );
                return Err(Error::from(call.invalid(msg)));
            }
            if let Some(e) = call.peer_failed() {
                return Err(Error::from(e));
            }
            queues = match wait_until(&mailbox.cv, queues, deadline) {
                Some(guard) => guard,
                None => return Err(Error::from(call.timeout(vec![src]))),
            };
        }
    }

    fn abort(&self, reason: &str) {
        // Only the first failure is kept: it is the root cause; later aborts are its echoes.
        let _ = self.world.failure.set((self.rank, reason.to_string()));
        // Each wake-up takes the lock first, so that no waiter misses it between its failure
        // check and its wait.
        let groups: Vec<_> = lock(&self.world.groups).values().cloned().collect();
        groups.iter().for_each(|g| g.wake_all());
        for m in &self.world.mailboxes {
            let _guard = lock(&m.queues);
            m.cv.notify_all();
        }
    }
}
