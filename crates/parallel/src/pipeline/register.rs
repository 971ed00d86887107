//! Pipeline parallelism's registration: the layers split over `pp × virtual_stages` chunks; the
//! pipeline group, its ends (tied embeddings) and the directions to the next and the previous
//! stage.

use crate::comm::Channel;
use crate::mesh::RankGroups;
use crate::register::{next_in, Dims, Parallelism};
use crate::ParallelConfig;

/// Pipeline parallelism, interleaved with virtual stages.
pub struct Pipeline;

impl Parallelism for Pipeline {
    fn problems(&self, c: &ParallelConfig, d: &Dims) -> Vec<String> {
        let mut p = Vec::new();
        match c.pp.checked_mul(c.virtual_stages) {
            None => p.push(format!(
                "parallel.pp × parallel.virtual_stages ({} × {}) overflows",
                c.pp, c.virtual_stages
            )),
            Some(chunks) if !d.layers.is_multiple_of(chunks) => p.push(format!(
                "parallel.pp × parallel.virtual_stages ({} × {}) must divide model.num_hidden_layers ({})",
                c.pp, c.virtual_stages, d.layers
            )),
            Some(_) => {}
        }
        if c.virtual_stages > 1 && c.pp == 1 {
            p.push("parallel.virtual_stages > 1 needs parallel.pp > 1".into());
        }
        p
    }

    fn channels(&self, rank: usize, g: &RankGroups) -> Vec<Channel> {
        let mut out = vec![
            Channel::Group(g.pp.clone()),
            Channel::Group(g.pipeline_ends.clone()),
        ];
        let n = g.pp.size();
        out.extend(next_in(rank, &g.pp, 1));
        out.extend(next_in(rank, &g.pp, n.saturating_sub(1)));
        out
    }

    fn describe(&self, c: &ParallelConfig) -> String {
        match c.virtual_stages {
            1 => format!("pp={}", c.pp),
            v => format!("pp={} (virtual {v})", c.pp),
        }
    }
}
