//! One registration place per parallelism. Each folder — `tp`, `cp`, `dp` (with ZeRO), `ep`,
//! `pipeline` — registers a [`Parallelism`] in its `register.rs`: what it checks of a layout
//! against the model and batch it splits ([`Dims`]), the channels a rank uses for it (created by
//! `Comm::prepare` before the first step) and its part of the layout line. The recipe check,
//! the trainer's channel list and the log line walk [`ALL`]; adding a parallelism is a folder and
//! one entry here. The same files hold each parallelism's communication terms for the planner
//! (`src/plan/time.rs` combines them with the compute): seconds from bytes, group sizes and link
//! bandwidths, with the latency [`LATENCY_S`] and the ring collective [`ring_s`] shared here.

use crate::comm::Channel;
use crate::mesh::RankGroups;
use crate::ParallelConfig;

/// The sizes of the model and batch a layout splits.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    /// Attention heads and key/value heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// The MLP's width.
    pub intermediate: usize,
    /// Vocabulary entries.
    pub vocab: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Tokens per training sequence.
    pub seq_len: usize,
    /// Experts per mixture-of-experts layer (none for a dense model).
    pub experts: Option<usize>,
    /// Whether the MoE layers cap the tokens per expert.
    pub expert_capacity: bool,
}

/// One parallelism's part of a job (see the module docs).
pub trait Parallelism: Sync {
    /// Its problems with layout `cfg` splitting `dims`, each naming its fields (sizes are at
    /// least 1 and the world fits; the recipe check has made sure).
    fn problems(&self, cfg: &ParallelConfig, dims: &Dims) -> Vec<String>;

    /// The channels rank `rank` with groups `groups` uses for it.
    fn channels(&self, rank: usize, groups: &RankGroups) -> Vec<Channel>;

    /// Its part of the layout line (`tp=2 +sp`), empty when it has none.
    fn describe(&self, cfg: &ParallelConfig) -> String;
}

/// Every parallelism, in the order of the layout line and of a rank's channel list.
pub const ALL: [&dyn Parallelism; 5] = [
    &crate::dp::register::Dp,
    &crate::tp::register::Tp,
    &crate::cp::register::Cp,
    &crate::pipeline::register::Pp,
    &crate::ep::register::Ep,
];

/// Latency of one collective (or one step of one), seconds: the planner's terms.
pub const LATENCY_S: f64 = 10e-6;

/// Planner term: seconds of a ring collective over `k` ranks of `bytes` (the whole tensor) at
/// `bw` bytes/s per link — `(k − 1)/k` of it through each link, a latency per rank.
pub fn ring_s(k: usize, bytes: f64, bw: f64) -> f64 {
    if k <= 1 {
        0.0
    } else {
        (k as f64 - 1.0) / k as f64 * bytes / bw + LATENCY_S * k as f64
    }
}

/// Every parallelism's problems with `cfg` splitting `dims`.
pub fn problems(cfg: &ParallelConfig, dims: &Dims) -> Vec<String> {
    ALL.iter().flat_map(|p| p.problems(cfg, dims)).collect()
}

/// The channels rank `rank` with groups `groups` uses, each parallelism's in [`ALL`] order.
pub fn channels(rank: usize, groups: &RankGroups) -> Vec<Channel> {
    ALL.iter().flat_map(|p| p.channels(rank, groups)).collect()
}

/// The communicators one rank holds on NCCL, by kind: what `Comm::prepare` creates for it from
/// the job's channels (one per group of two or more ranks it collects over, the world's
/// included; one per all-to-all group; one per point-to-point direction it sends or receives
/// on; one per ring it passes blocks around). Each holds GPU buffers outside the memory pool,
/// which the planner's headroom counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Communicators {
    /// Collective groups.
    pub groups: usize,
    /// All-to-all groups (expert parallelism).
    pub all_to_all: usize,
    /// Rings (context parallelism): two directions each.
    pub rings: usize,
    /// Point-to-point directions (pipeline neighbours).
    pub p2p: usize,
}

/// The [`Communicators`] of `rank` in layout `cfg`: the distinct channels that include it among
/// its own and those of the ranks that may send to it (a receiver's direction is listed by its
/// sender: point-to-point directions run along the pipeline-parallel groups only;
/// every member lists a group it collects over). The ranks looked at are bounded by `cp + pp`,
/// so that planning thousands of ranks stays fast.
pub fn communicators(
    cfg: &ParallelConfig,
    rank: usize,
) -> Result<Communicators, crate::mesh::MeshError> {
    let mesh = crate::mesh::Mesh::from_config(cfg)?;
    let shard = cfg.shard_size();
    let world = mesh.world_size();
    let mine = mesh.rank_groups(rank, shard);
    let mut peers: std::collections::BTreeSet<usize> = mine
        .cp
        .ranks()
        .iter()
        .chain(mine.pp.ranks())
        .copied()
        .collect();
    peers.insert(rank);
    let mut seen = std::collections::HashSet::new();
    let mut n = Communicators::default();
    // The job-wide group every job's channel list starts with.
    if seen.insert(Channel::Group(crate::Group::new((0..world).collect()))) && world > 1 {
        n.groups += 1;
    }
    for r in peers {
        for ch in channels(r, &mesh.rank_groups(r, shard)) {
            if !ch.includes(rank) || !seen.insert(ch.clone()) {
                continue;
            }
            match ch {
                Channel::Group(g) if g.size() > 1 => n.groups += 1,
                Channel::AllToAll(g) if g.size() > 1 => n.all_to_all += 1,
                Channel::Ring(g) if g.size() > 1 => n.rings += 1,
                Channel::P2p { src, dst } if src != dst => n.p2p += 1,
                _ => {}
            }
        }
    }
    Ok(n)
}

/// The most [`Communicators`] any rank of `cfg` holds, by kind: ranks differ only by their
/// pipeline stage (the first and last have fewer neighbours), so the first stage's first rank,
/// the second stage's and the last stage's are enough.
pub fn most_communicators(cfg: &ParallelConfig) -> Result<Communicators, crate::mesh::MeshError> {
    let mesh = crate::mesh::Mesh::from_config(cfg)?;
    let stages = mesh.group(crate::mesh::Axis::Pp, 0);
    let ranks = stages.ranks();
    let mut most = Communicators::default();
    for &r in [
        ranks[0],
        ranks[1.min(ranks.len() - 1)],
        ranks[ranks.len() - 1],
    ]
    .iter()
    {
        let c = communicators(cfg, r)?;
        most.groups = most.groups.max(c.groups);
        most.all_to_all = most.all_to_all.max(c.all_to_all);
        most.rings = most.rings.max(c.rings);
        most.p2p = most.p2p.max(c.p2p);
    }
    Ok(most)
}

/// A point-to-point direction from `rank` to the member `step` places after it in `group`
/// (none in a one-rank group).
pub(crate) fn next_in(rank: usize, group: &crate::Group, step: usize) -> Option<Channel> {
    let ranks = group.ranks();
    let n = ranks.len();
    let at = group.index_of(rank)?;
    (n > 1).then(|| Channel::P2p {
        src: rank,
        dst: ranks[(at + step) % n],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dp::ZeroStage;
    use crate::mesh::Mesh;

    fn dims() -> Dims {
        Dims {
            heads: 8,
            kv_heads: 4,
            intermediate: 64,
            vocab: 96,
            layers: 4,
            seq_len: 32,
            experts: Some(4),
            expert_capacity: false,
        }
    }

    /// Against the job's whole channel list (every rank's channels, as the trainer hands them to
    /// `Comm::prepare`) filtered to each rank, at layouts with every kind of group.
    #[test]
    fn communicators_are_the_channels_that_include_the_rank() {
        let layouts = [
            ParallelConfig::default(),
            ParallelConfig {
                dp: 2,
                tp: 2,
                pp: 2,
                ep: 2,
                virtual_stages: 2,
                zero: ZeroStage::Optimizer,
                ..ParallelConfig::default()
            },
            ParallelConfig {
                dp: 2,
                cp: 2,
                pp: 3,
                zero: ZeroStage::Parameters,
                zero_shard_size: Some(2),
                ..ParallelConfig::default()
            },
            ParallelConfig {
                dp: 4,
                pp: 4,
                ..ParallelConfig::default()
            },
        ];
        for c in layouts {
            let mesh = Mesh::from_config(&c).unwrap();
            let world = mesh.world_size();
            let mut all = vec![Channel::Group(crate::Group::new((0..world).collect()))];
            for r in 0..world {
                for ch in channels(r, &mesh.rank_groups(r, c.shard_size())) {
                    if !all.contains(&ch) {
                        all.push(ch);
                    }
                }
            }
            let mut most = Communicators::default();
            for r in 0..world {
                let mut want = Communicators::default();
                for ch in all.iter().filter(|ch| ch.includes(r)) {
                    match ch {
                        Channel::Group(g) if g.size() > 1 => want.groups += 1,
                        Channel::AllToAll(g) if g.size() > 1 => want.all_to_all += 1,
                        Channel::Ring(g) if g.size() > 1 => want.rings += 1,
                        Channel::P2p { src, dst } if src != dst => want.p2p += 1,
                        _ => {}
                    }
                }
                assert_eq!(
                    communicators(&c, r).unwrap(),
                    want,
                    "{} rank {r}",
                    c.describe()
                );
                most.groups = most.groups.max(want.groups);
                most.all_to_all = most.all_to_all.max(want.all_to_all);
                most.rings = most.rings.max(want.rings);
                most.p2p = most.p2p.max(want.p2p);
            }
            assert_eq!(most_communicators(&c).unwrap(), most, "{}", c.describe());
        }
        // One rank: no communicator at all.
        let one = most_communicators(&ParallelConfig::default()).unwrap();
        assert_eq!(one, Communicators::default());
    }

    #[test]
    fn every_parallelism_describes_checks_and_lists_its_channels() {
        let c = ParallelConfig {
            dp: 2,
            tp: 2,
            pp: 2,
            ep: 2,
            virtual_stages: 2,
            sequence_parallel: true,
            zero: ZeroStage::Optimizer,
            ..ParallelConfig::default()
        };
        assert_eq!(
            c.describe(),
            "dp=2 +zero1 tp=2 +sp cp=1 pp=2 (virtual 2) ep=2"
        );
        assert!(
            problems(&c, &dims()).is_empty(),
            "{:?}",
            problems(&c, &dims())
        );
        let bad = ParallelConfig {
            tp: 3,
            zero_shard_size: Some(2),
            ..c.clone()
        };
        let p = problems(&bad, &dims());
        assert!(
            p.iter().any(|e| e.contains("parallel.tp (3) must divide")),
            "{p:?}"
        );
        assert!(p.iter().any(|e| e.contains("parallel.ep = 2")), "{p:?}");
        // Rank 0 of 8 (tp 2 × dp 2 × pp 2): its groups and directions, each once.
        let mesh = Mesh::from_config(&c).unwrap();
        let ch = channels(0, &mesh.rank_groups(0, c.shard_size()));
        assert!(
            ch.contains(&Channel::Group(crate::Group::new(vec![0, 1]))),
            "tp"
        );
        assert!(ch.contains(&Channel::P2p { src: 0, dst: 4 }), "next stage");
        assert!(
            ch.contains(&Channel::AllToAll(crate::Group::new(vec![0, 2]))),
            "ep"
        );
        assert!(!ch.iter().any(|c| matches!(c, Channel::P2p { dst: 0, .. })));
    }
}
