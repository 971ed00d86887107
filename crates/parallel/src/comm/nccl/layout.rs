//! Pure helpers of the `nccl` backend: which communicator serves a call and the store keys of
//! its rendezvous (the axis moves around its flat buffers are `comm::flat`).

use std::fmt;

use crate::comm::Group;

/// Identifies one NCCL communicator of a rank.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) enum CommKey {
    /// Collectives over the group; NCCL rank `i` is member `i` of the group.
    Group(Group),
    /// All-to-all exchanges over the group (expert parallelism's tokens), on a communicator of
    /// their own: the same ranks may form a data-parallel group whose reductions run at the same
    /// time on another thread, and one communicator's operations must be issued in the same
    /// order on every member.
    AllToAll(Group),
    /// A ring's grouped hops over the group (context parallelism), on a communicator of their
    /// own for the same reason: with one data-parallel replica the ring's ranks are the
    /// gradient reduction's, which runs at the same time on the communication thread.
    Ring(Group),
    /// Messages from `src` to `dst` only (NCCL rank 0 is `src`, 1 is `dst`). Each direction has its
    /// own communicator so that a send never queues behind a receive of the other direction.
    P2p { src: usize, dst: usize },
}

impl CommKey {
    /// Global ranks of the members, in NCCL rank order.
    pub(super) fn members(&self) -> Vec<usize> {
        match self {
            CommKey::Group(g) | CommKey::AllToAll(g) | CommKey::Ring(g) => g.ranks().to_vec(),
            CommKey::P2p { src, dst } => vec![*src, *dst],
        }
    }

    /// Store key prefix of this communicator's rendezvous, under the instance prefix `prefix`:
    /// `{prefix}/group/0,2,4`, `{prefix}/all-to-all/0,2`, `{prefix}/ring/0,1` or
    /// `{prefix}/p2p/3->5`.
    pub(super) fn store_base(&self, prefix: &str) -> String {
        let list = |g: &Group| {
            let ranks: Vec<String> = g.ranks().iter().map(|r| r.to_string()).collect();
            ranks.join(",")
        };
        match self {
            CommKey::Group(g) => format!("{prefix}/group/{}", list(g)),
            CommKey::AllToAll(g) => format!("{prefix}/all-to-all/{}", list(g)),
            CommKey::Ring(g) => format!("{prefix}/ring/{}", list(g)),
            CommKey::P2p { src, dst } => format!("{prefix}/p2p/{src}->{dst}"),
        }
    }
}

impl fmt::Debug for CommKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommKey::Group(g) => write!(f, "group {g:?}"),
            CommKey::AllToAll(g) => write!(f, "all-to-all group {g:?}"),
            CommKey::Ring(g) => write!(f, "ring {g:?}"),
            CommKey::P2p { src, dst } => write!(f, "messages {src}->{dst}"),
        }
    }
}

/// Store key counting the `NcclComm`s created so far by `rank` (they are numbered per rank, in
/// creation order, so that the `k`-th instances of all ranks share keys and no others).
pub(super) fn instance_key(rank: usize) -> String {
    format!("nccl/instance/{rank}")
}

/// Store key prefix of instance `k`.
pub(super) fn instance_prefix(k: i64) -> String {
    format!("nccl/{k}")
}

/// Store keys of a communicator's rendezvous under `base` ([`CommKey::store_base`]).
pub(super) struct RendezvousKeys {
    /// The 128-byte NCCL unique id, set by member 0 before it arrives.
    pub id: String,
    /// Number of members that have arrived.
    pub count: String,
}

impl RendezvousKeys {
    pub(super) fn new(base: &str) -> Self {
        Self {
            id: format!("{base}/id"),
            count: format!("{base}/count"),
        }
    }

    /// Set to 1 once global rank `rank` has arrived (read only to name absent members).
    pub(super) fn here(base: &str, rank: usize) -> String {
        format!("{base}/here/{rank}")
    }
}

/// Store keys of the instance's failure record: `claim` (first `add` wins), then `rank` and
/// `reason`, then `count` (> 0 once `rank` and `reason` are readable).
pub(super) struct AbortKeys {
    pub claim: String,
    pub rank: String,
    pub reason: String,
    pub count: String,
}

impl AbortKeys {
    pub(super) fn new(prefix: &str) -> Self {
        Self {
            claim: format!("{prefix}/abort/claim"),
            rank: format!("{prefix}/abort/rank"),
            reason: format!("{prefix}/abort/reason"),
            count: format!("{prefix}/abort/count"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_the_group_or_direction() {
        let g = CommKey::Group(Group::new(vec![4, 0, 2]));
        assert_eq!(g.store_base("nccl/3"), "nccl/3/group/0,2,4");
        assert_eq!(g.members(), vec![0, 2, 4]);
        let a = CommKey::AllToAll(Group::new(vec![2, 0]));
        assert_eq!(a.store_base("nccl/3"), "nccl/3/all-to-all/0,2");
        assert_ne!(a, CommKey::Group(Group::new(vec![0, 2])));
        let p = CommKey::P2p { src: 5, dst: 3 };
        assert_eq!(p.store_base("nccl/0"), "nccl/0/p2p/5->3");
        assert_eq!(p.members(), vec![5, 3]);
        assert_ne!(p, CommKey::P2p { src: 3, dst: 5 });
        let k = RendezvousKeys::new("b");
        assert_eq!((k.id.as_str(), k.count.as_str()), ("b/id", "b/count"));
        assert_eq!(RendezvousKeys::here("b", 7), "b/here/7");
        assert_eq!(
            AbortKeys::new(&instance_prefix(2)).count,
            "nccl/2/abort/count"
        );
        assert_eq!(instance_key(1), "nccl/instance/1");
    }
}
