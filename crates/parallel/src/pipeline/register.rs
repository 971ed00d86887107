//! Pipeline parallelism's registration: the layers split over `pp × virtual_stages` chunks; the
//! pipeline group, its ends (tied embeddings) and the directions to the next and the previous
//! stage.

use crate::comm::Channel;
use crate::mesh::RankGroups;
use crate::register::{next_in, Dims, Parallelism, LATENCY_S};
use crate::ParallelConfig;

/// Pipeline parallelism, interleaved with virtual stages.
pub struct Pipeline;

impl Pipeline {
    /// Planner term: one transfer of `bytes` (an activation or its gradient) to a neighbouring
    /// stage at `bw` bytes/s.
    pub fn transfer_s(bytes: f64, bw: f64) -> f64 {
        bytes / bw + LATENCY_S
    }

    /// Planner term: the bubble of 1F1B and interleaved 1F1B over `pp` stages of `v` chunks,
    /// `(pp − 1)/v` of a mean stage's `mean_stage_s`.
    pub fn bubble_s(pp: usize, v: usize, mean_stage_s: f64) -> f64 {
        (pp as f64 - 1.0) / v as f64 * mean_stage_s
    }
}

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
