//! Every valid layout of a recipe on a number of GPUs: tensor parallelism inside a node, any
//! pipeline depth and interleaving the layer count allows with each schedule that runs it
//! (1F1B or zb-h1, interleaved or zbv with two chunks), data parallelism over the rest
//! (split by expert parallelism for a mixture-of-experts model), with or without sequence
//! parallelism, every ZeRO stage, every micro-batch size dividing the
//! per-rank batch, with recompute none, selective (the recipe's modules) or full, with fp32 or
//! bf16 AdamW moments, with AdamW's state on the device or offloaded to the host. The recipe's
//! own validation decides what is valid; each candidate is planned and those that fit are
//! ranked by throughput. bf16 moments and offload are levers, not preferences: a layout is
//! planned with them only where it does not fit without (offload still wins where it lets a
//! faster layout fit, e.g. without recompute). [`cheapest_fit`] varies only the memory levers of the
//! recipe's own layout.

use model::Recompute;
use parallel::dp::ZeroStage;
use parallel::pipeline::ScheduleKind;
use rayon::prelude::*;

use super::{plan, Hardware, Layout, Plan};
use crate::recipe::{Offload, OptimizerName, Recipe, StateDtype};

/// The recompute modes searched.
const RECOMPUTE: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

/// The plan of `layout` applied to `r`, if the recipe it makes is valid.
fn planned(r: &Recipe, hw: &Hardware, layout: Layout) -> Option<Plan> {
    let mut rr = layout.apply(r);
    let (par, layers) = (&rr.parallel, rr.model.num_hidden_layers);
    if par.pipeline_layout.is_none() && !layers.is_multiple_of(par.pp * par.virtual_stages) {
        // Stages that cannot be equal are balanced.
        rr.parallel.pipeline_layout = Some(super::time::balanced_layout(&rr, hw)?);
    }
    if !rr.problems().is_empty() {
        return None;
    }
    let p = plan(&rr, hw).ok()?;
    // A candidate is ranked with its stages balanced where that is faster.
    Some(match p.balanced {
        Some(b) => *b,
        None => p,
    })
}

/// The plan of `layout` with fp32 moments on the device, or else with the first of bf16
/// moments, an offloaded state, and both, that fits (offload only for AdamW); the fp32 plan
/// when none does.
fn planned_moments(r: &Recipe, hw: &Hardware, layout: Layout) -> Option<Plan> {
    let with = |state_dtype, offload| Layout {
        state_dtype,
        offload,
        ..layout
    };
    let fp32 = planned(r, hw, with(StateDtype::Fp32, Offload::None))?;
    if fp32.fits {
        return Some(fp32);
    }
    let bf16 = planned(r, hw, with(StateDtype::Bf16, Offload::None));
    if let Some(p) = bf16.as_ref().filter(|p| p.fits) {
        return Some(p.clone());
    }
    // Offload moves the optimizer column to the host and adds to the rest: where the rest alone
    // does not fit the device, it cannot help (most layouts of a search; planning them twice
    // more would double its time).
    let m = &fp32.memory_bytes;
    let rest = (m.total - m.optimizer + fp32.headroom_bytes) as f64;
    if r.optimizer.name != OptimizerName::AdamW || rest > hw.memory_gib * super::GIB {
        return Some(fp32);
    }
    [StateDtype::Fp32, StateDtype::Bf16]
        .into_iter()
        .filter_map(|d| planned(r, hw, with(d, Offload::Cpu)))
        .find(|p| p.fits)
        .or(Some(fp32))
}

/// The fastest plan of the recipe's own parallel layout that fits `hw`, varying only the memory
/// levers: ZeRO's stage, recompute and (where fp32 ones do not fit) bf16 moments; `None` when no
/// combination fits.
pub fn cheapest_fit(r: &Recipe, hw: &Hardware) -> Option<Plan> {
    let own = Layout::of(r);
    let shardable = own.dp * own.cp > 1;
    let stages = ZeroStage::ALL
        .into_iter()
        .filter(|z| !z.shards_optimizer() || shardable);
    stages
        .flat_map(|zero| RECOMPUTE.map(|rc| (zero, rc)))
        .filter_map(|(zero, recompute)| {
            let layout = Layout {
                zero,
                recompute,
                ..own
            };
            planned_moments(r, hw, layout)
        })
        .filter(|p| p.fits)
        .max_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s))
}

/// A planned layout.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Its prediction.
    pub plan: Plan,
    /// Whether it is the recipe's own layout.
    pub own: bool,
}

/// The schedules searched for `pp` stages of `v` chunks: 1F1B and zb-h1 with one chunk,
/// interleaved 1F1B and zbv with two, interleaved with more.
fn schedules(pp: usize, v: usize) -> Vec<ScheduleKind> {
    match (pp, v) {
        (1, _) => vec![ScheduleKind::OneFOneB],
        (_, 1) => vec![ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1],
        (_, 2) => vec![ScheduleKind::Interleaved, ScheduleKind::ZeroBubbleV],
        _ => vec![ScheduleKind::Interleaved],
    }
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
    let mut layouts = Vec::new();
    if !gpus.is_multiple_of(cp) {
        return Vec::new();
    }
    for tp in divisors(gpus / cp).filter(|&t| t <= hw.gpus_per_node) {
        for pp in divisors(gpus / (tp * cp)).filter(|&p| p <= layers) {
            let dp = gpus / (tp * cp * pp);
            let per_rank = r.train.global_batch / dp;
            if per_rank == 0 || !r.train.global_batch.is_multiple_of(dp) {
                continue;
            }
            // Virtual stages where the layers split evenly over them; one chunk per stage
            // otherwise (balanced by `planned`).
            let vs: Vec<usize> = if pp == 1 || !layers.is_multiple_of(pp) {
                vec![1]
            } else {
                divisors(layers / pp).collect()
            };
            let eps: Vec<usize> = divisors(dp)
                .filter(|&e| experts.is_multiple_of(e))
                .collect();
            for (&virtual_stages, &ep) in vs.iter().flat_map(|v| eps.iter().map(move |e| (v, e))) {
                for (schedule, sequence_parallel) in schedules(pp, virtual_stages)
                    .into_iter()
                    .flat_map(|k| [(k, false), (k, true)])
                    .filter(|&(_, s)| !s || tp > 1)
                {
                    let stages = ZeroStage::ALL.into_iter();
                    for zero in stages.filter(|z| !z.shards_optimizer() || dp * cp > 1) {
                        for micro_batch in divisors(per_rank) {
                            for recompute in RECOMPUTE {
                                let layout = Layout {
                                    dp,
                                    tp,
                                    cp,
                                    pp,
                                    ep,
                                    virtual_stages,
                                    schedule,
                                    sequence_parallel,
                                    zero,
                                    micro_batch,
                                    recompute,
                                    state_dtype: StateDtype::Fp32,
                                    offload: Offload::None,
                                };
                                layouts.push(layout);
                            }
                        }
                    }
                }
            }
        }
    }
    // Planned on every core, in the order listed (the sort below is stable).
    let mut out: Vec<Candidate> = layouts
        .into_par_iter()
        .filter_map(|layout| planned_moments(r, hw, layout))
        .map(|plan| Candidate {
            own: plan.layout == own,
            plan,
        })
        .collect();
    // The recipe's own layout on these GPUs is ranked with its moments' dtype as it is.
    if own.dp * own.tp * own.cp * own.pp == gpus && !out.iter().any(|c| c.own) {
        if let Some(plan) = planned(r, hw, own) {
            out.push(Candidate { plan, own: true });
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
