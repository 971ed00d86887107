//! Data parallelism's registration (with ZeRO): the gradient, shard, replica and expert
//! gradient groups, and the shard groups' sizes.

use crate::comm::Channel;
use crate::mesh::RankGroups;
use crate::register::{Dims, Parallelism};
use crate::ParallelConfig;

/// Data parallelism and ZeRO.
pub struct Data;

impl Parallelism for Data {
    fn problems(&self, c: &ParallelConfig, _: &Dims) -> Vec<String> {
        let mut p = Vec::new();
        if let Some(n) = c.zero_shard_size {
            if !c.zero.shards_optimizer() {
                p.push("parallel.zero_shard_size needs parallel.zero >= 1".into());
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
