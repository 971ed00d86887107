//! Expert parallelism's registration: the experts split over `ep` data-parallel ranks, which
//! exchange tokens by all-to-all (a group and an all-to-all channel).

use crate::comm::Channel;
use crate::mesh::RankGroups;
use crate::register::{Dims, Parallelism, LATENCY_S};
use crate::ParallelConfig;

/// Expert parallelism.
pub struct Ep;

impl Ep {
    /// Planner term: a MoE layer's two exchanges (dispatch and combine) in one direction, of
    /// `row_bytes` of routed rows over `ep` ranks, `(ep − 1)/ep` of them to other ranks, at `bw`
    /// bytes/s.
    pub fn exchange_s(ep: f64, row_bytes: f64, bw: f64) -> f64 {
        if ep <= 1.0 {
            return 0.0;
        }
        let bytes = row_bytes * (ep - 1.0) / ep;
        2.0 * (LATENCY_S + bytes / bw)
    }
}

impl Parallelism for Ep {
    fn problems(&self, c: &ParallelConfig, d: &Dims) -> Vec<String> {
        let mut p = Vec::new();
        let Some(experts) = d.experts else {
            if c.ep > 1 {
                p.push(format!(
                    "parallel.ep = {} needs mixture-of-experts layers (model.num_local_experts)",
                    c.ep
                ));
            }
            return p;
        };
        if c.ep <= 1 {
            return p;
        }
        if !c.dp.is_multiple_of(c.ep) {
            p.push(format!(
                "parallel.ep ({}) must divide parallel.dp ({}): expert-parallel ranks are \
                 data-parallel ranks that split the experts among them",
                c.ep, c.dp
            ));
        }
        if !experts.is_multiple_of(c.ep) {
            p.push(format!(
                "parallel.ep ({}) must divide model.num_local_experts ({experts})",
                c.ep
            ));
        }
        if c.zero_shard_size.is_some() {
            p.push(format!(
                "parallel.zero_shard_size with parallel.ep = {}: expert parallelism runs \
                 without hybrid sharding",
                c.ep
            ));
        }
        p
    }

    fn channels(&self, _rank: usize, g: &RankGroups) -> Vec<Channel> {
        vec![
            Channel::Group(g.ep.clone()),
            Channel::AllToAll(g.ep.clone()),
        ]
    }

    fn describe(&self, c: &ParallelConfig) -> String {
        if c.ep > 1 {
            format!("ep={}", c.ep)
        } else {
            String::new()
        }
    }
}
