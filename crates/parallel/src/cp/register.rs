//! Context parallelism's registration: each sequence splits into `2·cp` equal chunks, attention
//! runs as a ring over one group (its hops are grouped sends and receives on a ring channel of
//! their own); MoE layers are not split over it.

use crate::comm::Channel;
use crate::mesh::RankGroups;
use crate::register::{Dims, Parallelism, LATENCY_S};
use crate::ParallelConfig;

/// Context parallelism.
pub struct Cp;

impl Cp {
    /// Planner term: the ring's exposed seconds per decoder block, forward and backward, over
    /// `cp` ranks: `cp − 1` K/V blocks of `kv_bytes` each (in the backward with their f32 dK/dV
    /// accumulators, `(p + 4)/p` as many bytes for `p` bytes per element), each sent while the
    /// previous block computes, so only what the attention (`attn_s` of the forward, 2.5 × that
    /// in the backward) cannot cover, and the latencies, lengthen the step.
    pub fn ring_s(cp: f64, kv_bytes: f64, p: f64, bw: f64, attn_s: f64) -> (f64, f64) {
        if cp <= 1.0 {
            return (0.0, 0.0);
        }
        let steps = cp - 1.0;
        let fwd = steps * kv_bytes / bw;
        let bwd = steps * kv_bytes * (p + 4.0) / p / bw;
        (
            (fwd - attn_s).max(0.0) + steps * LATENCY_S,
            (bwd - 2.5 * attn_s).max(0.0) + 2.0 * steps * LATENCY_S,
        )
    }
}

impl Parallelism for Cp {
    fn problems(&self, c: &ParallelConfig, d: &Dims) -> Vec<String> {
        let mut p = Vec::new();
        if c.cp > 1 && !d.seq_len.is_multiple_of(2 * c.cp) {
            p.push(format!(
                "parallel.cp ({}) splits each sequence into 2·cp = {} chunks: train.seq_len ({}) \
                 must be divisible by {}",
                c.cp,
                2 * c.cp,
                d.seq_len,
                2 * c.cp
            ));
        }
        if c.cp > 1 && d.experts.is_some() {
            p.push(format!(
                "parallel.cp = {} with mixture-of-experts layers (model.num_local_experts): MoE \
                 layers run with parallel.dp, parallel.ep, parallel.tp, parallel.pp and ZeRO; set \
                 parallel.cp to 1",
                c.cp
            ));
        }
        p
    }

    fn channels(&self, _rank: usize, g: &RankGroups) -> Vec<Channel> {
        vec![Channel::Ring(g.cp.clone())]
    }

    fn describe(&self, c: &ParallelConfig) -> String {
        format!("cp={}", c.cp)
    }
}
