//! Tensor parallelism's registration: heads, the MLP and the vocabulary split over `tp` ranks,
//! and the sequence over them with sequence parallelism; one group.

use crate::comm::Channel;
use crate::mesh::RankGroups;
use crate::register::{Dims, Parallelism, LATENCY_S};
use crate::ParallelConfig;

/// Tensor (and sequence) parallelism.
pub struct Tp;

impl Tp {
    /// Planner term: seconds of a collective of `t` tensor-parallel ranks moving `factor × bytes`
    /// per rank at `bw` bytes/s, with a latency per step of its tree (`⌈log₂ t⌉`).
    pub fn collective_s(t: f64, factor: f64, bytes: f64, bw: f64) -> f64 {
        if t <= 1.0 {
            return 0.0;
        }
        LATENCY_S * t.log2().ceil().max(1.0) + factor * bytes / bw
    }

    /// Planner term: a decoder block's two region entries and two exits in one direction
    /// (all-reduces, or all-gathers and reduce-scatters with sequence parallelism), each moving
    /// `2 (t − 1)/t` of `bytes`, the `[n, h]` activation.
    pub fn block_s(t: f64, bytes: f64, bw: f64) -> f64 {
        2.0 * Self::collective_s(t, 2.0 * (t - 1.0) / t, bytes, bw)
    }
}

impl Parallelism for Tp {
    fn problems(&self, c: &ParallelConfig, d: &Dims) -> Vec<String> {
        let mut p = Vec::new();
        if !d.heads.is_multiple_of(c.tp) || !d.kv_heads.is_multiple_of(c.tp) {
            p.push(format!(
                "parallel.tp ({}) must divide model.num_attention_heads ({}) and model.num_key_value_heads ({})",
                c.tp, d.heads, d.kv_heads
            ));
        }
        for (field, n) in [
            ("model.intermediate_size", d.intermediate),
            ("model.vocab_size", d.vocab),
        ] {
            if !n.is_multiple_of(c.tp) {
                p.push(format!("parallel.tp ({}) must divide {field} ({n})", c.tp));
            }
        }
        if c.sequence_parallel && !(d.seq_len / c.cp).is_multiple_of(c.tp) {
            p.push(format!(
                "parallel.sequence_parallel: each rank's share of a sequence (train.seq_len / \
                 parallel.cp = {} / {}) must be divisible by parallel.tp ({})",
                d.seq_len, c.cp, c.tp
            ));
        }
        if d.expert_capacity && c.sequence_parallel && c.tp > 1 {
            p.push(
                "model.moe_expert_capacity_factor with parallel.sequence_parallel: each \
                 tensor-parallel rank routes its share of the sequence, and a capacity over a \
                 share would drop other tokens than over the micro-batch; turn one of them off"
                    .into(),
            );
        }
        p
    }

    fn channels(&self, _rank: usize, g: &RankGroups) -> Vec<Channel> {
        vec![Channel::Group(g.tp.clone())]
    }

    fn describe(&self, c: &ParallelConfig) -> String {
        let sp = if c.sequence_parallel { " +sp" } else { "" };
        format!("tp={}{sp}", c.tp)
    }
}
