//! Every valid layout of a recipe on a number of GPUs: tensor parallelism inside a node, any
//! pipeline depth and interleaving the layer count allows, data parallelism over the rest
//! (split by expert parallelism for a mixture-of-experts model), with or without sequence
//! parallelism, every ZeRO stage, every micro-batch size dividing the
//! per-rank batch, with and without recompute. The recipe's own validation decides what is
//! valid; each candidate is planned and those that fit are ranked by throughput.

use model::Recompute;
use parallel::dp::ZeroStage;

use super::{plan, Hardware, Layout, Plan};
use crate::recipe::Recipe;

/// A planned layout.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Its prediction.
    pub plan: Plan,
    /// Whether it is the recipe's own layout.
    pub own: bool,
}

fn divisors(n: usize) -> impl Iterator<Item = usize> {
    (1..=n).filter(move |d| n.is_multiple_of(*d))
}

/// Every valid layout of `r` on `gpus` GPUs with its plan, fitting ones first, each group by
/// predicted throughput (best first). The recipe's context parallelism is kept: it is chosen for
/// the sequence length, and the others split the rest.
pub fn candidates(r: &Recipe, hw: &Hardware, gpus: usize) -> Vec<Candidate> {
    let own = Layout::of(r);
    let (layers, cp) = (r.model.num_hidden_layers, r.parallel.cp);
    let experts = r.model.num_local_experts.unwrap_or(1);
    let mut out = Vec::new();
    if !gpus.is_multiple_of(cp) {
        return out;
    }
    for tp in divisors(gpus / cp).filter(|&t| t <= hw.gpus_per_node) {
        for pp in divisors(gpus / (tp * cp)).filter(|&p| layers.is_multiple_of(p)) {
            let dp = gpus / (tp * cp * pp);
            let per_rank = r.train.global_batch / dp;
            if per_rank == 0 || !r.train.global_batch.is_multiple_of(dp) {
                continue;
            }
            let vs: Vec<usize> = if pp == 1 {
                vec![1]
            } else {
                divisors(layers / pp).collect()
            };
            let eps: Vec<usize> = divisors(dp)
                .filter(|&e| experts.is_multiple_of(e))
                .collect();
            for (&virtual_stages, &ep) in vs.iter().flat_map(|v| eps.iter().map(move |e| (v, e))) {
                for sequence_parallel in [false, true].into_iter().filter(|&s| !s || tp > 1) {
                    let stages = ZeroStage::ALL.into_iter();
                    for zero in stages.filter(|z| !z.shards_optimizer() || dp * cp > 1) {
                        for micro_batch in divisors(per_rank) {
                            for recompute in [Recompute::None, Recompute::Full] {
                                let layout = Layout {
                                    dp,
                                    tp,
                                    cp,
                                    pp,
                                    ep,
                                    virtual_stages,
                                    sequence_parallel,
                                    zero,
                                    micro_batch,
                                    recompute,
                                };
                                let rr = layout.apply(r);
                                if !rr.problems().is_empty() {
                                    continue;
                                }
                                if let Ok(plan) = plan(&rr, hw) {
                                    out.push(Candidate {
                                        plan,
                                        own: layout == own,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out.sort_by(|a, b| {
        b.plan
            .fits
            .cmp(&a.plan.fits)
            .then(b.plan.tokens_per_s.total_cmp(&a.plan.tokens_per_s))
    });
    out
}
