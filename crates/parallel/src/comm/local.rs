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
//! - **NCCL's rules.** Point-to-point directions connect at both ends' first calls, channels are
//!   created by `prepare` with all their members, two threads of a rank never use one channel at
//!   once, and only NCCL's dtypes travel (submodule `rules`): what would hang or go wrong on GPUs
//!   fails here.
//! - **Messages.** A `send` (and each part of `send_recv` and `all_to_all`) copies its tensor
//!   into the receiver's lane for this sender and channel (NCCL: one communicator per direction,
//!   one per all-to-all group and ring); the receiver's k-th receive there takes the k-th
//!   message.
//!
//! Calls fail with a [`CommError`] whose message names the calling rank, the operation, the
//! group and the failed or missing ranks.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use candle_core::{DType, Shape, Tensor};

use crate::comm::Result;

use super::collective::{nccl_dtype, Kind};
use super::{
    check_all_to_all, check_send_recv, rows_exchange, Channel, Comm, CommError, Group, ReduceOp,
    Transfer,
};
use mailbox::Mailbox;
use rendezvous::GroupState;
use rules::{End, Rules};

mod mailbox;
mod rendezvous;
mod rules;
mod threads;

pub use threads::{run_local, RankFailed, ThreadError};

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
    rules: Rules,
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
            mailboxes: (0..world_size).map(|_| Mailbox::default()).collect(),
            rules: Rules::default(),
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
    /// How long the call waits (the job's timeout, or a barrier's own).
    timeout: Duration,
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
        let secs = self.timeout.as_secs_f64();
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
        let count = |m: &Mailbox| {
            lock(&m.lanes)
                .values()
                .map(|l| l.waiting.len())
                .sum::<usize>()
        };
        self.world.mailboxes.iter().map(count).sum()
    }

    fn call<'a>(&'a self, op: &'static str, group: &'a [usize]) -> Call<'a> {
        Call {
            me: self.rank,
            op,
            group,
            world: &self.world,
            timeout: self.world.timeout,
        }
    }

    /// Runs a collective that returns a tensor.
    fn tensor_op(&self, group: &Group, kind: Kind, t: &Tensor) -> Result<Tensor> {
        let timeout = self.world.timeout;
        match self.collective(group, kind, Some(t), timeout)? {
            Some(t) => Ok(t),
            None => Err(self
                .call(kind.name(), group.ranks())
                .invalid("internal: no result".into())),
        }
    }

    /// Runs one collective, waiting up to `timeout`; returns this member's result (`None` for a
    /// barrier).
    fn collective(
        &self,
        group: &Group,
        kind: Kind,
        t: Option<&Tensor>,
        timeout: Duration,
    ) -> Result<Option<Tensor>> {
        let call = Call {
            timeout,
            ..self.call(kind.name(), group.ranks())
        };
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
        if let Some(t) = t {
            self.check_dtype(&call, t.dtype())?;
        }
        let _inside;
        if group.size() > 1 {
            let channel = Channel::Group(group.clone());
            _inside = Some(self.world.rules.enter(&call, self.rank, &channel)?);
        }
        let deadline = Instant::now() + timeout;
        self.world
            .group_state(group)
            .run(&call, group, me, kind, t, deadline)
    }

    /// Refuses a dtype NCCL cannot move.
    fn check_dtype(&self, call: &Call<'_>, dtype: DType) -> Result<()> {
        match nccl_dtype(dtype) {
            true => Ok(()),
            false => Err(call.invalid(format!("dtype {dtype:?} is not supported by NCCL"))),
        }
    }

    /// Checks a point-to-point call's peer: another rank of the job.
    fn check_peer(&self, call: &Call<'_>, peer: usize) -> Result<()> {
        let n = self.world.world_size;
        if peer >= n {
            return Err(call.invalid(format!("no rank {peer} in a job of {n} ranks")));
        }
        if peer == self.rank {
            return Err(call.invalid("a rank cannot send to itself (NCCL refuses it)".into()));
        }
        match call.peer_failed() {
            Some(e) => Err(e),
            None => Ok(()),
        }
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
        self.barrier_within(group, self.world.timeout)
    }

    fn barrier_within(&self, group: &Group, timeout: Duration) -> Result<()> {
        let out = self.collective(group, Kind::Barrier, None, timeout);
        out.map(|_| ())
    }

    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        let pair = [self.rank, dst];
        let call = self.call("send", &pair);
        self.check_peer(&call, dst)?;
        self.check_dtype(&call, t.dtype())?;
        let channel = Channel::P2p {
            src: self.rank,
            dst,
        };
        let rules = &self.world.rules;
        let _inside = rules.enter(&call, self.rank, &channel)?;
        let deadline = Instant::now() + self.world.timeout;
        rules.connect(&call, (self.rank, dst), End::Send, true, deadline)?;
        self.world.post(self.rank, dst, channel, t)
    }

    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let pair = [src, self.rank];
        let call = self.call("recv", &pair);
        self.check_peer(&call, src)?;
        self.check_dtype(&call, dtype)?;
        let channel = Channel::P2p {
            src,
            dst: self.rank,
        };
        let rules = &self.world.rules;
        let _inside = rules.enter(&call, self.rank, &channel)?;
        let deadline = Instant::now() + self.world.timeout;
        // The data's arrival implies the connection: no separate wait for it.
        rules.connect(&call, (src, self.rank), End::Recv, false, deadline)?;
        let number = self.world.reserve(self.rank, src, channel.clone());
        let lane = (src, channel, number);
        self.world.take(&call, lane, (shape, dtype), deadline)
    }

    /// Posts the send at once and receives when waited for; grouped, so neither direction waits
    /// to connect.
    fn send_recv(&self, group: &Group, t: &Tensor, dst: usize, src: usize) -> Result<Transfer> {
        let call = self.call("send_recv", group.ranks());
        check_send_recv(self.rank, group, dst, src)?;
        self.check_dtype(&call, t.dtype())?;
        if let Some(e) = call.peer_failed() {
            return Err(e);
        }
        let channel = Channel::Ring(group.clone());
        let _inside = self.world.rules.enter(&call, self.rank, &channel)?;
        self.world.post(self.rank, dst, channel.clone(), t)?;
        let number = self.world.reserve(self.rank, src, channel.clone());
        let (world, me, group) = (self.world.clone(), self.rank, group.clone());
        let (shape, dtype) = (t.shape().clone(), t.dtype());
        Ok(Transfer::new(move || {
            let call = Call {
                me,
                op: "send_recv",
                group: group.ranks(),
                world: &world,
                timeout: world.timeout,
            };
            let deadline = Instant::now() + world.timeout;
            world.take(&call, (src, channel, number), (&shape, dtype), deadline)
        }))
    }

    /// NCCL's grouped form: every part is queued, then every part received; no direction waits
    /// to connect.
    fn all_to_all(
        &self,
        group: &Group,
        t: &Tensor,
        send: &[usize],
        recv: &[usize],
    ) -> Result<Tensor> {
        let call = self.call("all_to_all", group.ranks());
        let mine = check_all_to_all(self.rank, group, t.dim(0)?, send, recv)?;
        self.check_dtype(&call, t.dtype())?;
        if let Some(e) = call.peer_failed() {
            return Err(e);
        }
        let channel = Channel::AllToAll(group.clone());
        let _inside = match group.size() {
            1 => None,
            _ => Some(self.world.rules.enter(&call, self.rank, &channel)?),
        };
        let deadline = Instant::now() + self.world.timeout;
        let world = &self.world;
        rows_exchange(
            group,
            t,
            (send, recv, mine),
            |part, dst| world.post(self.rank, dst, channel.clone(), part),
            |src, shape| {
                let number = world.reserve(self.rank, src, channel.clone());
                let lane = (src, channel.clone(), number);
                world.take(&call, lane, (shape, t.dtype()), deadline)
            },
        )
    }

    /// Creates (waits for every member of) each channel with this rank and another member, in
    /// order; a point-to-point direction is also connected, both ends waiting for each other
    /// (see `rules`).
    fn prepare(&self, channels: &[Channel]) -> Result<()> {
        let me = self.rank;
        let rules = &self.world.rules;
        rules.mark_prepared(me, None);
        for channel in channels.iter().filter(|c| c.includes(me)) {
            let deadline = Instant::now() + self.world.timeout;
            match channel {
                Channel::Group(g) | Channel::AllToAll(g) | Channel::Ring(g) if g.size() > 1 => {
                    let call = self.call("prepare", g.ranks());
                    rules.create(&call, me, channel, deadline)?;
                }
                &Channel::P2p { src, dst } if src != dst => {
                    let pair = [src, dst];
                    let call = self.call("prepare", &pair);
                    rules.mark_prepared(me, Some(channel));
                    let end = if me == src { End::Send } else { End::Recv };
                    rules.connect(&call, (src, dst), end, true, deadline)?;
                }
                _ => rules.mark_prepared(me, Some(channel)),
            }
        }
        Ok(())
    }

    fn abort(&self, reason: &str) {
        // Only the first failure is kept: it is the root cause; later aborts are its echoes.
        let _ = self.world.failure.set((self.rank, reason.to_string()));
        // Each wake-up takes the lock first, so that no waiter misses it between its failure
        // check and its wait.
        let groups: Vec<_> = lock(&self.world.groups).values().cloned().collect();
        groups.iter().for_each(|g| g.wake_all());
        self.world.rules.wake_all();
        for m in &self.world.mailboxes {
            let _guard = lock(&m.lanes);
            m.cv.notify_all();
        }
    }
}
