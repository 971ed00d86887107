//! The mixture-of-experts feed-forward layer (Mixtral's sparse MoE block), dropless.
//!
//! ```text
//! x [n, h] ──router (f32)──> logits [n, E] ──softmax──> probs ──top-k──> experts [n, k], weights [n, k]
//!   │                                                                     (renormalised to sum 1)
//!   └─ permute: rows of x in (expert, token) order  x_perm [n·k, h]
//!        expert e: SwiGLU over its contiguous rows   y_perm [n·k, h]
//!      un-permute to (token, slot) order, weight, sum over the k slots  ──> y [n, h]
//! ```
//!
//! Every routed (token, slot) pair is computed (dropless, Mixtral's way) unless an expert
//! capacity is set (`moe_expert_capacity_factor`, training only): then each expert keeps at most
//! `ceil(factor · n · k / E)` pairs (by default its most probable; `moe_capacity_policy`), and
//! a dropped pair contributes nothing (its row reads an appended zero row when un-permuted). The
//! choice of experts is made on the host from the
//! probabilities (it is discrete and takes no gradient), or on the device when every expert's
//! rows are padded to its capacity (`padded.rs`: fixed shapes, no read back in a layer);
//! gradients reach the router through the selected probabilities (the routing weights) and the
//! balancing losses. The local experts run over their contiguous runs of the grouped rows, one
//! grouped call per projection (`ops::grouped_linear`: bit for bit each expert's own GEMM),
//! their SwiGLU as one op over all the rows. With expert parallelism the grouped
//! rows travel to the experts' ranks and back ([`ExpertParallel`]). The layer's forward and its
//! hand-written backward are in `pass.rs` ([`forward`], [`backward`]), checked against finite
//! differences and against a dense reference that runs every expert on every token with a top-k
//! mask (`tests/moe.rs`); the routing itself is in `routing.rs`.
//!
//! Losses of the layer (see `LlamaConfig::router_aux_loss_coef`): the load-balancing loss
//! `E · Σᵢ fᵢ·Pᵢ` (`fᵢ`: share of tokens choosing expert `i`, summing to `k`; `Pᵢ`: mean router
//! probability) and the z-loss `mean(logsumexp(logits)²)`. Their weighted sum, divided by the
//! number of MoE layers, is part of the objective: it takes no part in the block's output, so
//! the backward adds its gradients to the router's directly.

mod padded;
mod pass;
mod routing;

use candle_core::{DType, Result, Tensor, D};

use parallel::ep::ExpertParallel;
use parallel::tp::TensorParallel;

use crate::config::MoeConfig;
use crate::ops::linear;

pub use padded::{padded_tables, MAX_PADDED_EXPERTS};
pub use pass::{backward, forward, MoeGrads, MoeTape};
pub use routing::{apply_capacity, expert_order, route, Routing};
use routing::{Loads, Plan};

/// The weights of one SwiGLU expert (Mixtral's names): `w2(silu(w1 x) · w3 x)`.
#[derive(Debug, Clone)]
pub struct Expert {
    /// Gate projection `[f, h]`.
    pub w1: Tensor,
    /// Up projection `[f, h]`.
    pub w3: Tensor,
    /// Down projection `[h, f]`.
    pub w2: Tensor,
}

/// What one MoE layer measured on one micro-batch.
#[derive(Debug, Clone)]
pub struct LayerStats {
    /// Global index of the layer.
    pub layer: usize,
    /// The load-balancing and z-losses, unweighted.
    losses: LossValues,
    /// Tokens routed to each expert (all `E`; they sum to `n · k`), before any capacity, and the
    /// `(token, slot)` pairs the capacity dropped.
    loads: Loads,
}

/// A layer's two balancing losses: on the host, or still on the device (`[2]`: load balancing,
/// z-loss) so that a forward reads nothing back for them — a read waits for the device's queue
/// to drain — until [`LayerStats::read_all`] reads a whole step's in one transfer.
#[derive(Debug, Clone)]
enum LossValues {
    Host([f64; 2]),
    Device(Tensor),
}

impl LayerStats {
    /// The load-balancing loss (unweighted; `k` when perfectly balanced).
    pub fn load_balancing(&self) -> Result<f64> {
        Ok(self.losses()?[0])
    }

    /// The router z-loss (unweighted).
    pub fn z_loss(&self) -> Result<f64> {
        Ok(self.losses()?[1])
    }

    /// Tokens routed to each expert (all `E`; they sum to `n · k`), before any capacity.
    pub fn tokens_per_expert(&self) -> Result<Vec<u64>> {
        Ok(self.counts()?.0)
    }

    /// `(token, slot)` pairs the expert capacity dropped.
    pub fn dropped(&self) -> Result<u64> {
        Ok(self.counts()?.1)
    }

    fn counts(&self) -> Result<(Vec<u64>, u64)> {
        match &self.loads {
            Loads::Host {
                per_expert,
                dropped,
            } => Ok((per_expert.iter().map(|&c| c as u64).collect(), *dropped)),
            Loads::Device(t) => Ok(counts_of(&t.to_vec1::<f32>()?)),
        }
    }

    fn losses(&self) -> Result<[f64; 2]> {
        match &self.losses {
            LossValues::Host(v) => Ok(*v),
            LossValues::Device(t) => {
                let v = t.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                Ok([v[0], v[1]])
            }
        }
    }

    /// Reads the losses, loads and drops of every layer of `stats` still on the device, in one
    /// transfer per device.
    pub fn read_all(stats: &mut [LayerStats]) -> Result<()> {
        let mut pending: Vec<Tensor> = Vec::new();
        for s in stats.iter() {
            if let LossValues::Device(t) = &s.losses {
                pending.push(t.to_dtype(DType::F64)?); // [2]
            }
            if let Loads::Device(t) = &s.loads {
                pending.push(t.to_dtype(DType::F64)?); // [E + 1]
            }
        }
        if pending.is_empty() {
            return Ok(());
        }
        let all = Tensor::cat(&pending, 0)?.to_vec1::<f64>()?;
        let short = || candle_core::Error::Msg("MoE statistics: fewer values than layers".into());
        let mut at = 0;
        let mut take = |len: usize| -> Result<&[f64]> {
            let v = all.get(at..at + len).ok_or_else(short)?;
            at += len;
            Ok(v)
        };
        for s in stats.iter_mut() {
            if matches!(s.losses, LossValues::Device(_)) {
                let v = take(2)?;
                s.losses = LossValues::Host([v[0], v[1]]);
            }
            if let Loads::Device(t) = &s.loads {
                let v: Vec<f32> = take(t.elem_count())?.iter().map(|&x| x as f32).collect();
                let (per_expert, dropped) = counts_of(&v);
                s.loads = Loads::Host {
                    per_expert: per_expert.iter().map(|&c| c as usize).collect(),
                    dropped,
                };
            }
        }
        Ok(())
    }
}

/// Loads `[E]` then drops, as counted on the device (exact integers in f32), as host counts.
fn counts_of(v: &[f32]) -> (Vec<u64>, u64) {
    let (loads, dropped) = v.split_at(v.len().saturating_sub(1));
    let dropped = dropped.first().map_or(0, |&d| d as u64);
    (loads.iter().map(|&c| c as u64).collect(), dropped)
}

/// A MoE layer's router: its weight `[E, h]` and, with auxiliary-loss-free balancing, the
/// per-expert bias added to the probabilities when experts are chosen.
#[derive(Debug, Clone, Copy)]
pub struct Router<'a> {
    /// The router weight `[E, h]`.
    pub weight: &'a Tensor,
    /// `[E]` selection bias (not part of the routing weights).
    pub bias: Option<&'a [f32]>,
}

impl<'a> Router<'a> {
    /// A router without a selection bias.
    pub fn plain(weight: &'a Tensor) -> Self {
        Self { weight, bias: None }
    }
}

/// Softmax over the last dimension of f32 `logits` `[n, E]` with its log-sum-exp `[n]`.
fn softmax_lse(logits: &Tensor) -> Result<(Tensor, Tensor)> {
    let max = logits.max_keepdim(D::Minus1)?; // [n, 1]
    let e = logits.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?; // [n, 1]
    let probs = e.broadcast_div(&sum)?;
    let lse = (sum.log()? + max)?.squeeze(D::Minus1)?;
    Ok((probs, lse))
}

/// The router's probabilities `[n, E]` and log-sum-exps `[n]` of the rows of `x` `[n, h]`, in
/// f32 (f64 for f64 models, as the gradient checks run).
fn router_probs(x: &Tensor, weight: &Tensor) -> Result<(Tensor, Tensor)> {
    let rdt = router_dtype(x.dtype());
    let logits = linear(&x.to_dtype(rdt)?, &weight.to_dtype(rdt)?)?; // [n, E]
    softmax_lse(&logits)
}

/// The dtype of the router's arithmetic for inputs of dtype `dt`.
fn router_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Refuses a layer whose experts, over the expert-parallel group, are not the configured count.
fn check_experts(experts: usize, ep: &ExpertParallel, cfg: &MoeConfig, layer: usize) -> Result<()> {
    let e = cfg.num_experts;
    if experts * ep.size() != e {
        candle_core::bail!(
            "MoE layer {layer}: {experts} experts on each of {} expert-parallel ranks, {e} \
             configured",
            ep.size()
        );
    }
    Ok(())
}

/// The routing weights `[n, k]` (router dtype): the chosen probabilities, renormalised to sum
/// to 1 if configured.
fn routing_weights(probs: &Tensor, chosen: &Tensor, cfg: &MoeConfig) -> Result<Tensor> {
    let weights = probs.gather(chosen, 1)?;
    if cfg.norm_topk_prob {
        weights.broadcast_div(&weights.sum_keepdim(1)?)
    } else {
        Ok(weights)
    }
}

/// The experts' output rows `y_perm` `[rows, h]` back in (token, slot) order `[n, k, h]`; a
/// dropped pair reads an appended zero row.
fn unpermute(y_perm: &Tensor, plan: &Plan) -> Result<Tensor> {
    let h = y_perm.dim(1)?;
    with_zero_row(y_perm, plan.may_drop())?
        .index_select(&plan.inverse, 0)?
        .reshape((plan.n, plan.k, h))
}

/// `rows` `[r, h]` with a zero row appended (`[r + 1, h]`) when `zero`.
fn with_zero_row(rows: &Tensor, zero: bool) -> Result<Tensor> {
    if !zero {
        return Ok(rows.clone());
    }
    let z = Tensor::zeros((1, rows.dim(1)?), rows.dtype(), rows.device())?;
    Tensor::cat(&[rows, &z], 0)
}

/// The layer's output `[n, h]`: the slots' rows `yk` `[n, k, h]` weighted and summed.
fn weigh(yk: &Tensor, weights: &Tensor) -> Result<Tensor> {
    yk.broadcast_mul(&weights.to_dtype(yk.dtype())?.unsqueeze(2)?)?
        .sum(1)
}

/// The balancing losses of a micro-batch's routing (their values in the statistics) and what
/// their gradients need.
struct Losses {
    stats: LayerStats,
    /// `fᵢ` per expert `[E]` (router dtype): the micro-batch's share of tokens choosing it.
    share: Tensor,
    /// The tokens the losses' means run over (the micro-batch's, over a split group too).
    tokens: f64,
}

/// The load-balancing and z-losses of `probs` `[n, E]` and `lse` `[n]` routed by `plan`, this
/// rank's share of them when `tp` splits the tokens ([`split_losses`]).
fn losses(
    probs: &Tensor,
    lse: &Tensor,
    plan: &Plan,
    tp: &TensorParallel,
    layer: usize,
) -> Result<Losses> {
    let (n, e) = probs.dims2()?;
    let (per_expert, loads) = match &plan.loads {
        Loads::Host { per_expert, .. } => (per_expert, None),
        Loads::Device(t) => (&Vec::new(), Some(t)),
    };
    if tp.splits_sequence() {
        return match loads {
            None => split_losses(tp, probs, lse, per_expert, plan, layer),
            Some(_) => candle_core::bail!(
                "MoE layer {layer}: padded routing with the tokens split over tensor-parallel \
                 ranks (sequence parallelism)"
            ),
        };
    }
    let share = match loads {
        None => {
            let share: Vec<f64> = per_expert.iter().map(|&c| c as f64 / n as f64).collect();
            Tensor::from_vec(share, e, probs.device())?.to_dtype(probs.dtype())?
        }
        Some(t) => {
            // Divided (as the host's counts are), not multiplied by 1/n.
            let n = Tensor::full(n as f32, 1, probs.device())?.to_dtype(probs.dtype())?;
            t.narrow(0, 0, e)?
                .to_dtype(probs.dtype())?
                .broadcast_div(&n)?
        }
    };
    let load_balancing = ((probs.mean(0)? * &share)?.sum_all()? * e as f64)?;
    let z_loss = lse.sqr()?.mean_all()?;
    let stats = LayerStats {
        layer,
        losses: LossValues::Device(Tensor::stack(&[load_balancing, z_loss], 0)?),
        loads: plan.loads.clone(),
    };
    Ok(Losses {
        stats,
        share,
        tokens: n as f64,
    })
}

/// The router's side of a forward (either pass): probabilities `[n, E]` and log-sum-exps `[n]`
/// (router dtype), the routing plan, the routing weights `[n, k]`, and the input's rows in
/// expert order `[rows, h]`.
struct Routed {
    probs: Tensor,
    lse: Tensor,
    plan: Plan,
    weights: Tensor,
    x_perm: Tensor,
}

/// Routes the rows of `x` `[n, h]` (see [`Routed`]) for `experts` local experts.
fn route_rows(
    x: &Tensor,
    router: &Router,
    experts: usize,
    ep: &ExpertParallel,
    cfg: &MoeConfig,
    layer: usize,
) -> Result<Routed> {
    check_experts(experts, ep, cfg, layer)?;
    let (probs, lse) = router_probs(x, router.weight)?; // [n, E], [n]
    let plan = Plan::new(&probs, router, cfg, layer)?;
    let weights = routing_weights(&probs, &plan.chosen, cfg)?; // [n, k]
    let x_perm = with_zero_row(x, plan.padded)?.index_select(&plan.tokens, 0)?; // [rows, h]
    Ok(Routed {
        probs,
        lse,
        plan,
        weights,
        x_perm,
    })
}

/// The balancing losses when the micro-batch's tokens are split over the tensor-parallel group
/// (sequence parallelism): the token counts, probability sums and squared log-sum-exps of all
/// members are summed ([`TensorParallel::sum_over_sequence`]), and this rank's losses are its
/// share — the terms of its own tokens with the micro-batch's expert shares `fᵢ` — so that the
/// members' gradients (summed over the group for replicated parameters) add up to the
/// micro-batch's. The statistics are the micro-batch's, alike on every member.
fn split_losses(
    tp: &TensorParallel,
    probs: &Tensor,
    lse: &Tensor,
    counts: &[usize],
    plan: &Plan,
    layer: usize,
) -> Result<Losses> {
    let e = counts.len();
    let (dev, rdt) = (probs.device(), probs.dtype());
    let p_sum = probs.sum(0)?; // [E], this rank's tokens
    let lse2 = lse.sqr()?.sum_all()?;
    let mut host: Vec<f64> = counts.iter().map(|&c| c as f64).collect();
    host.extend(p_sum.to_dtype(DType::F64)?.to_vec1::<f64>()?);
    host.push(lse2.to_dtype(DType::F64)?.to_scalar::<f64>()?);
    host.push(lse.dim(0)? as f64);
    let all = tp.sum_over_sequence(host)?;
    let tokens = all[2 * e + 1].max(1.0);
    let share: Vec<f64> = all[..e].iter().map(|&c| c / tokens).collect();
    let load_balancing = e as f64
        * share
            .iter()
            .zip(&all[e..2 * e])
            .map(|(f, p)| f * p)
            .sum::<f64>()
        / tokens;
    let dropped = match plan.loads {
        Loads::Host { dropped, .. } => dropped,
        Loads::Device(_) => 0, // refused by the caller
    };
    let stats = LayerStats {
        layer,
        losses: LossValues::Host([load_balancing, all[2 * e] / tokens]),
        loads: Loads::Host {
            per_expert: all[..e].iter().map(|&c| c as usize).collect(),
            dropped,
        },
    };
    let share = Tensor::from_vec(share, e, dev)?.to_dtype(rdt)?;
    Ok(Losses {
        stats,
        share,
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn losses_left_on_the_device_are_read_together_in_layer_order() {
        let dev = Device::Cpu;
        let on_device = |layer: usize, lb: f32, z: f32, loads: &[f32]| LayerStats {
            layer,
            losses: LossValues::Device(Tensor::new(&[lb, z], &dev).unwrap()),
            loads: Loads::Device(Tensor::new(loads, &dev).unwrap()),
        };
        let mut stats = vec![
            on_device(0, 2.5, 0.25, &[3.0, 1.0, 2.0]),
            LayerStats {
                layer: 1,
                losses: LossValues::Host([1.0, 0.5]),
                loads: Loads::Host {
                    per_expert: vec![4, 0],
                    dropped: 1,
                },
            },
            on_device(2, 3.0, 0.75, &[0.0, 4.0, 0.0]),
        ];
        assert_eq!(stats[2].z_loss().unwrap(), 0.75); // a single read works too
        LayerStats::read_all(&mut stats).unwrap();
        assert!(stats
            .iter()
            .all(|s| matches!(s.losses, LossValues::Host(_))));
        let got: Vec<(f64, f64)> = stats
            .iter()
            .map(|s| (s.load_balancing().unwrap(), s.z_loss().unwrap()))
            .collect();
        assert_eq!(got, [(2.5, 0.25), (1.0, 0.5), (3.0, 0.75)]);
        let loads: Vec<(Vec<u64>, u64)> = stats
            .iter()
            .map(|s| (s.tokens_per_expert().unwrap(), s.dropped().unwrap()))
            .collect();
        assert_eq!(
            loads,
            [(vec![3, 1], 2), (vec![4, 0], 1), (vec![0, 4], 0)],
            "each layer's loads, then its drops"
        );
        assert!(stats.iter().all(|s| matches!(s.loads, Loads::Host { .. })));
    }
}
