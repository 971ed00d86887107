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
    &crate::dp::register::Data,
    &crate::tp::register::Tensor,
    &crate::cp::register::Context,
    &crate::pipeline::register::Pipeline,
    &crate::ep::register::Expert,
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
