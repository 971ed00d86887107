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
//! `ceil(factor · n · k / E)` pairs, those with the highest probability, and a dropped pair
//! contributes nothing (its row reads an appended zero row when un-permuted). The choice of
//! experts is made on the host from the probabilities (it is discrete and takes no gradient);
//! gradients reach the router through the selected probabilities (the routing weights) and the
//! balancing losses. Each expert is one GEMM chain over its contiguous rows, cut from the grouped
//! rows by a balanced tree of `narrow`s ([`split_rows`]). The whole layer is composed of
//! differentiable ops (gather, index select, narrow, cat, the fused `linear`/`swiglu`), checked
//! against finite differences and against a dense reference that runs every expert on every
//! token with a top-k mask (`tests/moe.rs`). With expert parallelism the grouped rows travel to
//! the experts' ranks and back ([`ExpertParallel`]).
//!
//! Losses of the layer (see `LlamaConfig::router_aux_loss_coef`): the load-balancing loss
//! `E · Σᵢ fᵢ·Pᵢ` (`fᵢ`: share of tokens choosing expert `i`, summing to `k`; `Pᵢ`: mean router
//! probability) and the z-loss `mean(logsumexp(logits)²)`; the model adds their weighted sum,
//! divided by the number of MoE layers, to the objective with [`crate::ops::with_side_loss`].

use std::cmp::Ordering;

use candle_core::{DType, Device, Result, Tensor, D};

use parallel::ep::ExpertParallel;
use parallel::tp::TpGroup;
use parallel::ReduceOp;

use crate::config::MoeConfig;
use crate::ops::{linear, swiglu};

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
#[derive(Debug, Clone, PartialEq)]
pub struct LayerStats {
    /// Global index of the layer.
    pub layer: usize,
    /// The load-balancing loss (unweighted; `k` when perfectly balanced).
    pub load_balancing: f64,
    /// The router z-loss (unweighted).
    pub z_loss: f64,
    /// Tokens routed to each expert (all `E`; they sum to `n · k`), before any capacity.
    pub tokens_per_expert: Vec<u64>,
    /// `(token, slot)` pairs the expert capacity dropped.
    pub dropped: u64,
}

/// The layer's output.
pub struct MoeOutput {
    /// `[n, h]`, the dtype of the input.
    pub y: Tensor,
    /// `coef_lb · load_balancing + coef_z · z_loss` (f32 scalar, f64 for f64; with its graph).
    pub aux_loss: Tensor,
    /// The measurements.
    pub stats: LayerStats,
}

/// The experts chosen for each token: `experts[t · k + j]` is token `t`'s `j`-th choice (in
/// descending probability; ties go to the lower expert index), `counts[e]` the tokens routed to
/// expert `e`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routing {
    /// `[n · k]` expert ids.
    pub experts: Vec<u32>,
    /// `[E]` tokens per expert.
    pub counts: Vec<usize>,
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

/// Top-`k` of each row of `probs` (`[n, e]`, row-major), ranked by `probs + bias` when a bias
/// `[e]` is given.
pub fn route(probs: &[f32], bias: Option<&[f32]>, e: usize, k: usize) -> Routing {
    let n = probs.len() / e;
    let mut experts = Vec::with_capacity(n * k);
    let mut counts = vec![0usize; e];
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    let mut biased = vec![0f32; if bias.is_some() { e } else { 0 }];
    for row in probs.chunks_exact(e) {
        let row = match bias {
            Some(b) => {
                for ((s, &p), &b) in biased.iter_mut().zip(row).zip(b) {
                    *s = p + b;
                }
                &biased[..]
            }
            None => row,
        };
        best.clear();
        for (j, &p) in row.iter().enumerate() {
            // Insert j after every kept expert with a probability >= p (stable: lower index
            // first on ties; NaN sorts last).
            let at = best
                .iter()
                .position(|&b| {
                    row[b as usize]
                        .partial_cmp(&p)
                        .is_none_or(|o| o == Ordering::Less)
                })
                .unwrap_or(best.len());
            if at < k {
                best.insert(at, j as u32);
                best.truncate(k);
            }
        }
        for &b in &best {
            counts[b as usize] += 1;
        }
        experts.extend_from_slice(&best);
    }
    Routing { experts, counts }
}

/// The order of the `(token, slot)` pairs grouped by expert (stable within an expert):
/// `order[i]` is the pair at permuted row `i`.
pub fn expert_order(r: &Routing) -> Vec<u32> {
    expert_order_of(&r.experts, &r.counts, None)
}

/// [`expert_order`] of the pairs `kept` (all without), `counts` being the kept pairs per expert.
fn expert_order_of(experts: &[u32], counts: &[usize], kept: Option<&[bool]>) -> Vec<u32> {
    let mut next: Vec<usize> = counts
        .iter()
        .scan(0, |at, &c| {
            let start = *at;
            *at += c;
            Some(start)
        })
        .collect();
    let mut order = vec![0u32; counts.iter().sum()];
    for (pair, &e) in experts.iter().enumerate() {
        if kept.is_some_and(|k| !k[pair]) {
            continue;
        }
        order[next[e as usize]] = pair as u32;
        next[e as usize] += 1;
    }
    order
}

/// Expert capacity: which `(token, slot)` pairs of `r` each expert keeps when it takes at most
/// `capacity` of them — those with the highest probability (`probs` `[n, e]`, row-major; ties
/// to the lower pair) — and the kept pairs per expert.
pub fn apply_capacity(
    r: &Routing,
    probs: &[f32],
    e: usize,
    k: usize,
    capacity: usize,
) -> (Vec<bool>, Vec<usize>) {
    let mut kept = vec![true; r.experts.len()];
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); e];
    for (pair, &x) in r.experts.iter().enumerate() {
        by_expert[x as usize].push(pair);
    }
    let prob = |pair: usize| probs[pair / k * e + r.experts[pair] as usize];
    for pairs in by_expert.iter_mut().filter(|p| p.len() > capacity) {
        pairs.sort_by(|&a, &b| prob(b).total_cmp(&prob(a)).then(a.cmp(&b)));
        for &dropped in &pairs[capacity..] {
            kept[dropped] = false;
        }
    }
    let counts = by_expert.iter().map(|p| p.len().min(capacity)).collect();
    (kept, counts)
}

/// Appends to `out` the rows of `x` of each expert (`counts[e]` consecutive rows each; `None`
/// for an expert without rows), cut by halving the expert range recursively. The gradient of a
/// `narrow` is a zero-padded tensor of its input's size, so cutting every expert straight from
/// `x` would cost `E` full-size gradients in the backward; a balanced tree of cuts costs about
/// two per level, `2·log₂ E` in all.
fn split_rows(x: &Tensor, counts: &[usize], out: &mut Vec<Option<Tensor>>) -> Result<()> {
    match counts {
        [] => Ok(()),
        [count] => {
            out.push((*count > 0).then(|| x.clone()));
            Ok(())
        }
        _ => {
            let mid = counts.len() / 2;
            let (left, right) = counts.split_at(mid);
            let rows: usize = left.iter().sum();
            for (part, start, len) in [(left, 0, rows), (right, rows, x.dim(0)? - rows)] {
                if len == 0 {
                    out.extend(part.iter().map(|_| None));
                } else if len == x.dim(0)? {
                    split_rows(x, part, out)?;
                } else {
                    split_rows(&x.narrow(0, start, len)?, part, out)?;
                }
            }
            Ok(())
        }
    }
}

/// Softmax over the last dimension of f32 `logits` `[n, E]` with its log-sum-exp `[n]`, both
/// differentiable (the subtracted row maximum is a constant for autograd).
fn softmax_lse(logits: &Tensor) -> Result<(Tensor, Tensor)> {
    let max = logits.max_keepdim(D::Minus1)?.detach(); // [n, 1]
    let e = logits.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?; // [n, 1]
    let probs = e.broadcast_div(&sum)?;
    let lse = (sum.log()? + max)?.squeeze(D::Minus1)?;
    Ok((probs, lse))
}

/// The MoE layer on `x` `[n, h]` with `router` and this rank's experts of layer `layer`
/// (all `E`, or its share of the expert-parallel group `ep`, which the rows travel to). With
/// `split`, the micro-batch's tokens are split over that group (sequence parallelism) and the
/// balancing losses are this rank's share of the micro-batch's ([`split_losses`]).
pub fn forward(
    x: &Tensor,
    router: &Router,
    experts: &[Expert],
    ep: &ExpertParallel,
    split: Option<&TpGroup>,
    cfg: &MoeConfig,
    layer: usize,
) -> Result<MoeOutput> {
    let (n, h) = x.dims2()?;
    let (e, k) = (cfg.num_experts, cfg.top_k);
    if experts.len() * ep.size() != e {
        candle_core::bail!(
            "MoE layer {layer}: {} experts on each of {} expert-parallel ranks, {e} configured",
            experts.len(),
            ep.size()
        );
    }
    let dev = x.device();
    // Router math in f32 (f64 for f64 models, as the gradient checks run).
    let rdt = if x.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let logits = linear(&x.to_dtype(rdt)?, &router.weight.to_dtype(rdt)?)?; // [n, E]
    let (probs, lse) = softmax_lse(&logits)?;
    let host = probs
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    if let Some(b) = router.bias.filter(|b| b.len() != e) {
        candle_core::bail!(
            "MoE layer {layer}: {} selection biases for {e} experts",
            b.len()
        );
    }
    let routing = route(&host, router.bias, e, k);

    // Routing weights [n, k]: the chosen probabilities, renormalised if configured.
    let chosen = Tensor::from_slice(&routing.experts, (n, k), dev)?;
    let mut weights = probs.gather(&chosen, 1)?;
    if cfg.norm_topk_prob {
        weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
    }

    // With a capacity, each expert keeps its most probable pairs; the others are dropped.
    let (kept, counts) = match cfg.capacity_factor {
        Some(factor) => {
            let capacity = (factor * (n * k) as f64 / e as f64).ceil() as usize;
            let (kept, counts) = apply_capacity(&routing, &host, e, k, capacity);
            (Some(kept), counts)
        }
        None => (None, routing.counts.clone()),
    };

    // Rows grouped by expert, sent to the ranks holding their experts (no-op without expert
    // parallelism), each local expert over its contiguous rows, and back.
    let order = expert_order_of(&routing.experts, &counts, kept.as_deref());
    let rows = order.len(); // n·k, less what the capacity dropped
    let tokens: Vec<u32> = order.iter().map(|&p| p / k as u32).collect();
    let x_perm = x.index_select(&Tensor::from_vec(tokens, rows, dev)?, 0)?; // [rows, h]
    let (x_local, dispatch) = ep.dispatch(&x_perm, &counts)?; // [m, h]
    let mut outs = Vec::with_capacity(experts.len());
    let mut inputs = Vec::with_capacity(experts.len());
    split_rows(&x_local, &dispatch.counts, &mut inputs)?;
    for (ex, xe) in experts.iter().zip(inputs) {
        let Some(xe) = xe else { continue }; // [count, h]
        let g = swiglu(&linear(&xe, &ex.w1)?, &linear(&xe, &ex.w3)?)?; // [count, f]
        outs.push(linear(&g, &ex.w2)?); // [count, h]
    }
    // No local rows: the (empty) input stands in, so the backward still reaches the dispatch
    // and every member of the group takes part in its reverse all-to-all.
    let y_local = if outs.is_empty() {
        x_local
    } else {
        Tensor::cat(&outs, 0)?
    }; // [m, h]
    let mut y_perm = ep.combine(&y_local, &dispatch)?; // [rows, h]

    // Back to (token, slot) order (a dropped pair reads an appended zero row), weighted, summed
    // over the slots.
    let mut inverse = vec![rows as u32; n * k];
    for (row, &pair) in order.iter().enumerate() {
        inverse[pair as usize] = row as u32;
    }
    if rows < n * k {
        let zero = Tensor::zeros((1, h), y_perm.dtype(), dev)?;
        y_perm = Tensor::cat(&[&y_perm, &zero], 0)?; // [rows + 1, h]
    }
    let y = y_perm
        .index_select(&Tensor::from_vec(inverse, n * k, dev)?, 0)?
        .reshape((n, k, h))?;
    let y = y
        .broadcast_mul(&weights.to_dtype(x.dtype())?.unsqueeze(2)?)?
        .sum(1)?; // [n, h]

    // Balancing losses.
    let (load_balancing, z_loss, mut stats) = match split {
        None => {
            let share: Vec<f64> = routing
                .counts
                .iter()
                .map(|&c| c as f64 / n as f64)
                .collect();
            let share = Tensor::from_vec(share, e, dev)?.to_dtype(rdt)?;
            let load_balancing = ((probs.mean(0)? * share)?.sum_all()? * e as f64)?;
            let z_loss = lse.sqr()?.mean_all()?;
            let stats = LayerStats {
                layer,
                load_balancing: load_balancing.to_dtype(DType::F64)?.to_scalar::<f64>()?,
                z_loss: z_loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
                tokens_per_expert: routing.counts.iter().map(|&c| c as u64).collect(),
                dropped: 0,
            };
            (load_balancing, z_loss, stats)
        }
        Some(group) => split_losses(group, &probs, &lse, &routing.counts, layer)?,
    };
    stats.dropped = (n * k - rows) as u64;
    let aux_loss = ((&load_balancing * cfg.aux_loss_coef)? + (&z_loss * cfg.z_loss_coef)?)?;
    Ok(MoeOutput { y, aux_loss, stats })
}

/// The balancing losses when the micro-batch's tokens are split over `group` (sequence
/// parallelism): the token counts, probability sums and squared log-sum-exps of all members are
/// summed (one host all-reduce), and this rank's losses are its share — the terms of its own
/// tokens with the micro-batch's expert shares `fᵢ` — so that the members' losses (and
/// gradients, which are summed over the group for replicated parameters) add up to the
/// micro-batch's. The statistics are the micro-batch's, alike on every member.
fn split_losses(
    group: &TpGroup,
    probs: &Tensor,
    lse: &Tensor,
    counts: &[usize],
    layer: usize,
) -> Result<(Tensor, Tensor, LayerStats)> {
    let e = counts.len();
    let (dev, rdt) = (probs.device(), probs.dtype());
    let p_sum = probs.sum(0)?; // [E], this rank's tokens
    let lse2 = lse.sqr()?.sum_all()?;
    let mut host: Vec<f64> = counts.iter().map(|&c| c as f64).collect();
    host.extend(p_sum.to_dtype(DType::F64)?.to_vec1::<f64>()?);
    host.push(lse2.to_dtype(DType::F64)?.to_scalar::<f64>()?);
    host.push(lse.dim(0)? as f64);
    let len = host.len();
    let all = group
        .comm
        .all_reduce(
            &group.group,
            &Tensor::from_vec(host, len, &Device::Cpu)?,
            ReduceOp::Sum,
        )?
        .to_device(&Device::Cpu)?
        .to_vec1::<f64>()?;
    let tokens = all[2 * e + 1].max(1.0);
    let share: Vec<f64> = all[..e].iter().map(|&c| c / tokens).collect();
    let stats = LayerStats {
        layer,
        load_balancing: e as f64
            * share
                .iter()
                .zip(&all[e..2 * e])
                .map(|(f, p)| f * p)
                .sum::<f64>()
            / tokens,
        z_loss: all[2 * e] / tokens,
        tokens_per_expert: all[..e].iter().map(|&c| c as u64).collect(),
        dropped: 0,
    };
    let share = Tensor::from_vec(share, e, dev)?.to_dtype(rdt)?;
    let load_balancing = ((p_sum * share)?.sum_all()? * (e as f64 / tokens))?;
    let z_loss = (lse2 / tokens)?;
    Ok((load_balancing, z_loss, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_keeps_each_experts_most_probable_pairs() {
        // Four tokens, top-1 over two experts: expert 0 is chosen three times.
        let probs = [0.9, 0.1, 0.6, 0.4, 0.6, 0.4, 0.2, 0.8];
        let r = route(&probs, None, 2, 1);
        assert_eq!(r.experts, vec![0, 0, 0, 1]);
        let (kept, counts) = apply_capacity(&r, &probs, 2, 1, 2);
        // Expert 0 keeps 0.9 and the first of the tied 0.6s.
        assert_eq!(kept, vec![true, true, false, true]);
        assert_eq!(counts, vec![2, 1]);
        let order = expert_order_of(&r.experts, &counts, Some(&kept));
        assert_eq!(order, vec![0, 1, 3]);
    }

    #[test]
    fn rows_are_split_by_expert_with_none_for_idle_experts() {
        let x = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((6, 2))
            .unwrap();
        let mut parts = Vec::new();
        split_rows(&x, &[3, 0, 2, 1, 0], &mut parts).unwrap();
        let rows: Vec<Option<Vec<f32>>> = parts
            .iter()
            .map(|p| {
                p.as_ref()
                    .map(|t| t.flatten_all().unwrap().to_vec1().unwrap())
            })
            .collect();
        assert_eq!(
            rows,
            vec![
                Some(vec![0., 1., 2., 3., 4., 5.]),
                None,
                Some(vec![6., 7., 8., 9.]),
                Some(vec![10., 11.]),
                None
            ]
        );
        let mut none = Vec::new();
        split_rows(&x.narrow(0, 0, 0).unwrap(), &[0, 0, 0], &mut none).unwrap();
        assert!(none.iter().all(Option::is_none) && none.len() == 3);
    }

    #[test]
    fn top_k_is_stable_and_counts() {
        // Three tokens over four experts, k = 2; the second row has a tie (0.3, 0.3).
        let probs = [
            0.1,
            0.6,
            0.2,
            0.1, //
            0.3,
            0.1,
            0.3,
            0.3, //
            f32::NAN,
            0.5,
            0.4,
            0.1,
        ];
        let r = route(&probs, None, 4, 2);
        assert_eq!(r.experts, vec![1, 2, 0, 2, 1, 2]);
        assert_eq!(r.counts, vec![1, 2, 3, 0]);
        let order = expert_order(&r);
        // Expert 0: pair 2; expert 1: pairs 0, 4; expert 2: pairs 1, 3, 5.
        assert_eq!(order, vec![2, 0, 4, 1, 3, 5]);
        // A bias moves the choice, not the probabilities: expert 3 now wins the first row.
        let r = route(&probs, Some(&[0.0, 0.0, 0.0, 0.55]), 4, 2);
        assert_eq!(&r.experts[..2], &[3, 1]);
    }
}
