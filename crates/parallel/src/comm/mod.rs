//! The `Comm` trait: collectives and point-to-point transfers over groups of ranks, with every
//! wait bounded by a timeout and every failure reported with the rank and the operation.

pub(crate) mod collective;
pub mod failure;
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) mod flat;
pub mod flight;
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) mod guard;
pub mod in_place;
pub mod local;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod tcp;
pub mod thread;
mod transfer;

use std::fmt;
use std::sync::Arc;

use candle_core::{DType, Shape, Tensor};

pub use in_place::HandOff;
pub use transfer::Transfer;

/// A set of ranks taking part in a collective, as sorted global ranks. Member `i` of the group is
/// `ranks()[i]`; collectives order contributions by member index.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Group {
    ranks: Arc<[usize]>,
}

impl Group {
    /// A group of these global ranks (sorted, deduplicated).
    pub fn new(mut ranks: Vec<usize>) -> Self {
        ranks.sort_unstable();
        ranks.dedup();
        Self {
            ranks: ranks.into(),
        }
    }

    /// The member ranks in order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Member index of global `rank`, if it belongs to the group.
    pub fn index_of(&self, rank: usize) -> Option<usize> {
        self.ranks.iter().position(|&r| r == rank)
    }
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.ranks)
    }
}

/// A communication channel of a job, as a backend may need to set it up before its first use
/// (an NCCL communicator).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Channel {
    /// Collectives over the group.
    Group(Group),
    /// All-to-all exchanges over the group ([`Comm::all_to_all`]).
    AllToAll(Group),
    /// A ring's grouped hops over the group ([`Comm::send_recv`]).
    Ring(Group),
    /// Point-to-point messages from `src` to `dst`.
    P2p {
        /// Sender.
        src: usize,
        /// Receiver.
        dst: usize,
    },
}

impl Channel {
    /// Whether global rank `rank` takes part.
    pub fn includes(&self, rank: usize) -> bool {
        match self {
            Channel::Group(g) | Channel::AllToAll(g) | Channel::Ring(g) => {
                g.index_of(rank).is_some()
            }
            Channel::P2p { src, dst } => *src == rank || *dst == rank,
        }
    }
}

/// Reduction of an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise maximum.
    Max,
}

/// What every [`Comm`] call returns.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// Why a communication operation failed. [`Comm`] returns it as is; model code, whose results
/// are candle's, converts it once with `?` (see the `From` impl below).
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// Another rank failed (its error or panic); pending and later operations end with this.
    #[error("rank {me}: {op} over ranks {group:?} aborted: rank {failed} failed: {reason}")]
    PeerFailed {
        me: usize,
        op: &'static str,
        group: Vec<usize>,
        failed: usize,
        reason: String,
    },
    /// The peers did not arrive in time.
    #[error("rank {me}: {op} over ranks {group:?} timed out after {secs:.1}s waiting for ranks {missing:?}")]
    Timeout {
        me: usize,
        op: &'static str,
        group: Vec<usize>,
        secs: f64,
        missing: Vec<usize>,
    },
    /// The call itself is wrong (rank not in group, shapes that disagree across ranks, ...).
    #[error("rank {me}: {op} over ranks {group:?}: {message}")]
    Invalid {
        me: usize,
        op: &'static str,
        group: Vec<usize>,
        message: String,
    },
    /// A tensor operation of the call failed on this rank (a copy, an allocation, the device).
    #[error("{0}")]
    Tensor(Arc<candle_core::Error>),
}

/// A tensor operation's failure inside a communication call; a [`CommError`] carried inside the
/// candle error (a callback's, a nested call's) comes back as itself.
impl From<candle_core::Error> for CommError {
    fn from(e: candle_core::Error) -> Self {
        match CommError::find(&e) {
            Some(c) => c.clone(),
            None => CommError::Tensor(Arc::new(e)),
        }
    }
}

impl CommError {
    /// Whether this rank stopped because another rank failed (not a failure of its own: a rank
    /// that aborted itself also sees `PeerFailed` naming itself on its later calls).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, CommError::PeerFailed { me, failed, .. } if me != failed)
    }

    /// The `CommError` an error was made from, found through candle's wrappers (context,
    /// backtraces, paths), `std::io::Error` and the `source()` chain.
    pub fn find<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a CommError> {
        if let Some(c) = e.downcast_ref::<CommError>() {
            return Some(c);
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if let Some(inner) = io.get_ref() {
                return Self::find(inner);
            }
        }
        if let Some(c) = e.downcast_ref::<candle_core::Error>() {
            use candle_core::Error as E;
            let inner: Option<&(dyn std::error::Error + 'static)> = match c {
                E::Context { inner, .. }
                | E::WithBacktrace { inner, .. }
                | E::WithPath { inner, .. } => Some(inner.as_ref()),
                E::Io(io) => Some(io),
                E::WrappedContext { wrapped, .. } => Some(wrapped.as_ref()),
                _ => None,
            };
            if let Some(found) = inner.and_then(Self::find) {
                return Some(found);
            }
        }
        e.source().and_then(Self::find)
    }
}

/// A communication failure as a candle error, for model code (whose results are candle's) to
/// return with `?`: the one conversion at the boundary. A tensor operation's own failure is
/// given back as it was; the others travel as `candle_core::Error::Io`, the one candle variant
/// whose payload is a `std::error::Error` that can be downcast, so [`CommError::find`] recovers
/// the typed error further up (a launcher telling a peer's failure from a rank's own).
impl From<CommError> for candle_core::Error {
    fn from(e: CommError) -> Self {
        let kind = match e {
            CommError::PeerFailed { .. } => std::io::ErrorKind::ConnectionAborted,
            CommError::Timeout { .. } => std::io::ErrorKind::TimedOut,
            CommError::Invalid { .. } => std::io::ErrorKind::InvalidInput,
            CommError::Tensor(inner) => {
                return Arc::try_unwrap(inner)
                    .unwrap_or_else(|shared| candle_core::Error::Msg(shared.to_string()))
            }
        };
        candle_core::Error::Io(std::io::Error::new(kind, e))
    }
}

/// Collectives and point-to-point transfers among the ranks of one job.
///
/// Every member of a group must call the same collectives on that group in the same order (as
/// with NCCL). Results are identical on every member: reductions add contributions in member
/// order. All calls return an error instead of hanging: after the backend's timeout, or as soon as
/// any rank calls [`Comm::abort`].
pub trait Comm: Send + Sync {
    /// This rank's global index.
    fn rank(&self) -> usize;
    /// Number of ranks in the job.
    fn world_size(&self) -> usize;
    /// Element-wise reduction of every member's `t` (same shape and dtype everywhere).
    fn all_reduce(&self, group: &Group, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    /// Members' `t` concatenated along `dim` in member order.
    fn all_gather(&self, group: &Group, t: &Tensor, dim: usize) -> Result<Tensor>;
    /// Sum of members' `t`, cut along `dim` into `group.size()` equal chunks; member `i` gets chunk `i`.
    fn reduce_scatter(&self, group: &Group, t: &Tensor, dim: usize) -> Result<Tensor>;
    /// Global rank `root`'s `t`, on every member (other members' `t` gives only shape and dtype).
    fn broadcast(&self, group: &Group, t: &Tensor, root: usize) -> Result<Tensor>;
    /// Sends `t` to global rank `dst` (does not wait for the matching `recv`).
    fn send(&self, t: &Tensor, dst: usize) -> Result<()>;
    /// Receives the next tensor sent by global rank `src`, which must have `shape` and `dtype`.
    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor>;
    /// Returns once every member has called it.
    fn barrier(&self, group: &Group) -> Result<()>;
    /// [`Comm::barrier`] waiting up to `timeout` rather than the backend's timeout: a
    /// checkpoint's barriers wait for the slowest rank's writes, which a shared file system at
    /// many writers can make far slower than any collective.
    fn barrier_within(&self, group: &Group, timeout: std::time::Duration) -> Result<()>;
    /// Sends `t` to member `dst` of `group` and receives a tensor of `t`'s shape and dtype from
    /// member `src` (global ranks, neither of them this rank), as one grouped operation on the
    /// group's ring channel ([`Channel::Ring`]): NCCL runs both in one
    /// `ncclGroupStart`/`ncclGroupEnd` on a communicator of their own, so the two directions
    /// connect together and a ring of these cannot deadlock (a plain `send` waits for its
    /// peer's first `recv`, see [`local`]). Returns at
    /// once; [`Transfer::wait`] gives the received tensor, so the transfer overlaps the work
    /// queued before the wait. `t` must not be updated in place before then. Members of the
    /// group that exchange this way do so at the same points of their sequences of calls on
    /// it. (No default: a wrapper that fell back to `send` and `recv` would lose the grouping.)
    fn send_recv(&self, group: &Group, t: &Tensor, dst: usize, src: usize) -> Result<Transfer>;
    /// All-to-all with variable splits along dim 0: `t`'s rows are cut into `send[j]` rows for
    /// member `j` (in member order); the result is the rows each member `j` sent to this rank
    /// (`recv[j]` of them) concatenated in member order. `send` and `recv` have one entry per
    /// member and every member's `send[i]` must equal member `i`'s `recv` entry for it (the
    /// callers exchange counts first). By default point-to-point transfers
    /// ([`all_to_all_p2p`]); NCCL groups its sends and receives into one launch.
    fn all_to_all(
        &self,
        group: &Group,
        t: &Tensor,
        send: &[usize],
        recv: &[usize],
    ) -> Result<Tensor> {
        all_to_all_p2p(self, group, t, send, recv)
    }
    /// A mark of the device work the calling thread has queued so far, for in-place operations
    /// it hands to the communication thread (see [`in_place`]). None by default.
    fn hand_off(&self) -> Result<HandOff> {
        Ok(HandOff::none())
    }
    /// [`Comm::all_reduce`] in place: `t` (contiguous) becomes the reduction. The operation
    /// waits for the device work `after` marks (see [`in_place`]).
    fn all_reduce_in_place(
        &self,
        group: &Group,
        t: &Tensor,
        op: ReduceOp,
        after: &HandOff,
    ) -> Result<()> {
        let _ = after;
        in_place::through_copies::all_reduce(self, group, t, op)
    }
    /// [`Comm::reduce_scatter`] along dim 0 in place: `t` (contiguous) is cut into
    /// `group.size()` chunks, and this rank's chunk (member `i`: chunk `i`) becomes the sum of
    /// every member's chunk there; returned as a view of `t`. The other chunks are unspecified
    /// afterwards. Waits for the device work `after` marks.
    fn reduce_scatter_in_place(
        &self,
        group: &Group,
        t: &Tensor,
        after: &HandOff,
    ) -> Result<Tensor> {
        let _ = after;
        in_place::through_copies::reduce_scatter(self, group, t)
    }
    /// [`Comm::all_gather`] along dim 0 in place: `t` (contiguous) holds one chunk per member,
    /// this rank's own contribution in its chunk; afterwards chunk `j` is member `j`'s. Waits for
    /// the device work `after` marks.
    fn all_gather_in_place(&self, group: &Group, t: &Tensor, after: &HandOff) -> Result<()> {
        let _ = after;
        in_place::through_copies::all_gather(self, group, t)
    }
    /// Sets up, in the given order, what the backend needs for the channels this rank takes part
    /// in (NCCL: one communicator each, whose creation waits for all its members). Every rank
    /// passes the same list — the job's channels in one global order — so no two ranks wait for
    /// each other's creations in opposite orders, and no creation happens inside a step. The
    /// `local` and `tcp` backends need nothing.
    fn prepare(&self, channels: &[Channel]) -> Result<()> {
        let _ = channels;
        Ok(())
    }
    /// Declares this rank failed with `reason`: every pending and future operation of every rank
    /// returns [`CommError::PeerFailed`] naming this rank.
    fn abort(&self, reason: &str);
}

/// Checks a [`Comm::send_recv`] call by rank `me`: both peers are other members of `group`.
pub(crate) fn check_send_recv(me: usize, group: &Group, dst: usize, src: usize) -> Result<()> {
    let invalid = |message: String| CommError::Invalid {
        me,
        op: "send_recv",
        group: group.ranks().to_vec(),
        message,
    };
    if group.index_of(me).is_none() {
        return Err(invalid("this rank is not a member".into()));
    }
    for (what, peer) in [("destination", dst), ("source", src)] {
        if peer == me || group.index_of(peer).is_none() {
            return Err(invalid(format!(
                "{what} rank {peer} is not another member of the group"
            )));
        }
    }
    Ok(())
}

/// Checks an all-to-all call (see [`Comm::all_to_all`]) by rank `me` on `rows` rows; returns
/// this rank's member index.
pub(crate) fn check_all_to_all(
    me: usize,
    group: &Group,
    rows: usize,
    send: &[usize],
    recv: &[usize],
) -> Result<usize> {
    let invalid = |message: String| CommError::Invalid {
        me,
        op: "all_to_all",
        group: group.ranks().to_vec(),
        message,
    };
    let Some(mine) = group.index_of(me) else {
        return Err(invalid("this rank is not a member".into()));
    };
    let n = group.size();
    if send.len() != n || recv.len() != n {
        return Err(invalid(format!(
            "{} send and {} receive counts for {n} members",
            send.len(),
            recv.len()
        )));
    }
    if send.iter().sum::<usize>() != rows {
        return Err(invalid(format!(
            "send counts {send:?} do not add up to the {rows} rows sent"
        )));
    }
    if send[mine] != recv[mine] {
        return Err(invalid(format!(
            "sends {} rows to itself but expects {}",
            send[mine], recv[mine]
        )));
    }
    Ok(mine)
}

/// [`Comm::all_to_all`] as point-to-point transfers: every chunk is sent (sends do not wait for
/// their receive), then every chunk received, so no order of members can deadlock once the
/// directions are connected; empty chunks are not transferred and this rank's own chunk is not
/// copied through the backend.
pub fn all_to_all_p2p<C: Comm + ?Sized>(
    comm: &C,
    group: &Group,
    t: &Tensor,
    send: &[usize],
    recv: &[usize],
) -> Result<Tensor> {
    let mine = check_all_to_all(comm.rank(), group, t.dim(0)?, send, recv)?;
    rows_exchange(
        group,
        t,
        (send, recv, mine),
        |part, dst| comm.send(part, dst),
        |src, shape| comm.recv(src, shape, t.dtype()),
    )
}

/// The exchange of an all-to-all (checked: `mine` is this rank's member index): `post(part, dst)`
/// for each non-empty chunk of `t`'s rows for another member, in member order, then
/// `take(src, shape)` for each non-empty chunk another member sent here; the result is the
/// received chunks (this rank's own in its place) concatenated in member order.
pub(crate) fn rows_exchange(
    group: &Group,
    t: &Tensor,
    (send, recv, mine): (&[usize], &[usize], usize),
    mut post: impl FnMut(&Tensor, usize) -> Result<()>,
    mut take: impl FnMut(usize, &Shape) -> Result<Tensor>,
) -> Result<Tensor> {
    let mut at = 0;
    let mut own = None;
    for (j, &count) in send.iter().enumerate() {
        let chunk = t.narrow(0, at, count)?;
        at += count;
        if j == mine {
            own = Some(chunk);
        } else if count > 0 {
            post(&chunk.contiguous()?, group.ranks()[j])?;
        }
    }
    let mut dims = t.dims().to_vec();
    let mut parts = Vec::with_capacity(group.size());
    for (j, &count) in recv.iter().enumerate() {
        if count == 0 {
            continue;
        }
        if j == mine {
            parts.extend(own.take());
        } else {
            dims[0] = count;
            let shape = Shape::from(dims.clone());
            parts.push(take(group.ranks()[j], &shape)?);
        }
    }
    if parts.is_empty() {
        return Ok(t.narrow(0, 0, 0)?.contiguous()?);
    }
    let device = t.device();
    let parts = parts
        .iter()
        .map(|p| p.to_device(device))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}
