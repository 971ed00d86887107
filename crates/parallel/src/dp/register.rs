//! Data parallelism's registration (with ZeRO): the gradient, shard, replica and expert
//! gradient groups, and the shard groups' sizes.

use crate::comm::Channel;
use crate::dp::ZeroStage;
use crate::mesh::RankGroups;
use crate::register::{ring_s, Dims, Parallelism};
use crate::ParallelConfig;

/// Data parallelism and ZeRO.
pub struct Dp;

/// The planner's seconds of a step's data-parallel synchronisation at one stage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyncCost {
    /// What can run beside the backward passes.
    pub overlapped: f64,
    /// What runs after them (the updated parameters' all-gather of stages 1 and 2).
    pub after: f64,
    /// Whether the overlapped part is per micro-batch (stages 2 and 3, which can hide behind
    /// the whole schedule), or one reduction behind the last backward (stages 0 and 1).
    pub per_micro: bool,
}

/// The groups and sizes a step's synchronisation moves.
#[derive(Debug, Clone, Copy)]
pub struct SyncSizes {
    /// Ranks of the gradient group, and of a shard group in it.
    pub grad_ranks: usize,
    /// Ranks of a ZeRO shard group.
    pub shard: usize,
    /// Micro-batches per step.
    pub micro_batches: f64,
    /// Bytes of the stage's fp32 gradient buffer, and of its parameters.
    pub grad_bytes: f64,
    /// Bytes of the stage's parameters in the training dtype.
    pub param_bytes: f64,
    /// Bandwidths of the gradient group and of a shard group, bytes/s.
    pub grad_bw: f64,
    /// Bandwidth of a shard group, bytes/s.
    pub shard_bw: f64,
}

impl Dp {
    /// Planner term: a step's gradient synchronisation at ZeRO stage `zero` — stage 0 all-reduces
    /// the gradients; stage 1 reduce-scatters them (all-reducing across replica groups) and
    /// gathers the updated parameters; stages 2 and 3 reduce-scatter every micro-batch's, and
    /// stage 3 gathers the parameters before each use (forward and backward) while stage 2
    /// gathers the updated ones after the step.
    pub fn sync_s(zero: ZeroStage, s: SyncSizes) -> SyncCost {
        let (grads, shard) = (s.grad_bytes, s.shard);
        let replicas = s.grad_ranks / shard;
        match zero {
            ZeroStage::Off => SyncCost {
                overlapped: 2.0 * ring_s(s.grad_ranks, grads, s.grad_bw),
                after: 0.0,
                per_micro: false,
            },
            ZeroStage::Optimizer => SyncCost {
                overlapped: ring_s(shard, grads, s.shard_bw)
                    + 2.0 * ring_s(replicas, grads / shard as f64, s.grad_bw),
                after: ring_s(shard, grads, s.shard_bw),
                per_micro: false,
            },
            ZeroStage::Gradients | ZeroStage::Parameters => {
                let per_micro = ring_s(shard, grads, s.shard_bw);
                let replica = 2.0 * ring_s(replicas, grads / shard as f64, s.grad_bw);
                let uses = if zero.shards_parameters() {
                    2.0 * s.micro_batches
                } else {
                    0.0
                };
                let gathers = uses * ring_s(shard, s.param_bytes, s.shard_bw);
                let publish = if zero == ZeroStage::Gradients {
                    ring_s(shard, grads, s.shard_bw)
                } else {
                    0.0
                };
                SyncCost {
                    overlapped: s.micro_batches * per_micro + replica + gathers,
                    after: publish,
                    per_micro: true,
                }
            }
        }
    }
}

impl Parallelism for Dp {
    fn problems(&self, c: &ParallelConfig, _: &Dims) -> Vec<String> {
        let mut p = Vec::new();
        if c.bucket_size > crate::config::MAX_BUCKET_SIZE {
            p.push(format!(
                "parallel.bucket_size ({}) exceeds {} elements: a bucket is processed whole by \
                 CUDA kernels indexing with 32 bits",
                c.bucket_size,
                crate::config::MAX_BUCKET_SIZE
            ));
        }
        if let Some(n) = c.zero_shard_size {
            if !c.zero.shards_optimizer() {
                p.push("parallel.zero_shard_size needs parallel.zero >= 1".into());
            } else if n == 1 {
                p.push(
                    "parallel.zero_shard_size is 1, which shards nothing: use parallel.zero: 0 \
                     (plain replication), or a size of at least 2"
                        .into(),
                );
            } else if n == 0 || !c.grad_ranks().is_multiple_of(n) {
                p.push(format!(
                    "parallel.zero_shard_size ({n}) must divide parallel.dp × parallel.cp ({} × {})",
                    c.dp, c.cp
                ));
            }
        }
        p
    }

    fn channels(&self, _rank: usize, g: &RankGroups) -> Vec<Channel> {
        [&g.grad, &g.shard, &g.replicate, &g.expert_grad]
            .map(|g| Channel::Group(g.clone()))
            .to_vec()
    }

    fn describe(&self, c: &ParallelConfig) -> String {
        let mut s = format!("dp={}", c.dp);
        if c.zero.shards_optimizer() {
            s += &format!(" +zero{}", c.zero);
            if let Some(n) = c.zero_shard_size {
                s += &format!(" (shards of {n})");
            }
        }
        s
    }
}
