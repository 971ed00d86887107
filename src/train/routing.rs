//! How a step's mixture-of-experts layers routed: their router losses and the balance of tokens
//! over experts, summed over every micro-batch's forward of the step on every rank (each pipeline
//! stage measures its own layers, each data-parallel rank its own micro-batches; the executor
//! hands on what the layers measured, `StepRun::moe`).

use std::collections::BTreeMap;

use anyhow::Result;
use candle_core::{Device, Tensor};
use model::moe::LayerStats;
use model::LlamaConfig;
use parallel::ReduceOp;
use serde::Serialize;

use super::RankCtx;

/// One MoE layer over a step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerRouting {
    /// Global layer index.
    pub layer: usize,
    /// Mean load-balancing loss over the step's micro-batches (unweighted; `k` is balanced).
    pub load_balancing: f64,
    /// Mean router z-loss over the step's micro-batches (unweighted).
    pub z_loss: f64,
    /// Tokens of the busiest expert over the mean tokens per expert (1 is balanced).
    pub max_over_mean: f64,
    /// Tokens of the idlest expert over the mean (0: an expert got no token in the step).
    pub min_over_mean: f64,
    /// The experts' loads' coefficient of variation: their standard deviation over their mean
    /// (0 balanced; `sqrt(E − 1)` when one expert takes every token).
    pub cv: f64,
    /// With an expert capacity: the share of routed `(token, slot)` pairs it dropped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropped: Option<f64>,
    /// Tokens routed to each expert over the step on all ranks; not written to the metrics.
    #[serde(skip)]
    pub tokens_per_expert: Vec<f64>,
}

/// Every MoE layer over a step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepRouting {
    /// Mean of the layers' load-balancing losses.
    pub load_balancing: f64,
    /// Mean of the layers' z-losses.
    pub z_loss: f64,
    /// The largest `max_over_mean` of the layers.
    pub max_over_mean: f64,
    /// The largest `cv` of the layers.
    pub cv: f64,
    /// With an expert capacity: the mean over layers of the share of pairs dropped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropped: Option<f64>,
    /// Each MoE layer.
    pub layers: Vec<LayerRouting>,
    /// With auxiliary-loss-free balancing: the largest expert selection bias (in magnitude)
    /// after this step's update.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias_max_abs: Option<f64>,
}

/// Sums what the MoE layers of model `c` measured in this step's forwards on this rank
/// (`stats`) over the pipeline and data-parallel ranks (a collective: every rank calls it every
/// step of a MoE model). `None` for a dense model. Means are per micro-batch.
pub fn gather(
    c: &LlamaConfig,
    mut stats: Vec<LayerStats>,
    ctx: &RankCtx,
) -> Result<Option<StepRouting>> {
    let Some(moe) = c.moe() else {
        return Ok(None);
    };
    let layers: Vec<usize> = (0..c.num_hidden_layers)
        .filter(|&l| c.is_moe_layer(l))
        .collect();
    let e = moe.num_experts;
    let width = 4 + e; // forwards, Σ load balancing, Σ z-loss, dropped, tokens per expert
    let mut sums = vec![0f64; layers.len() * width];
    LayerStats::read_all(&mut stats)?; // the step's one read of them
    for s in stats {
        let Some(at) = layers.iter().position(|&l| l == s.layer) else {
            continue;
        };
        let row = &mut sums[at * width..(at + 1) * width];
        row[0] += 1.0;
        row[1] += s.load_balancing()?;
        row[2] += s.z_loss()?;
        row[3] += s.dropped()? as f64;
        for (dst, &n) in row[4..].iter_mut().zip(&s.tokens_per_expert()?) {
            *dst += n as f64;
        }
    }
    for group in [&ctx.groups.pp, &ctx.groups.grad] {
        if group.size() > 1 {
            let t = Tensor::from_vec(sums, layers.len() * width, &Device::Cpu)?;
            sums = ctx.comm.all_reduce(group, &t, ReduceOp::Sum)?.to_vec1()?;
        }
    }
    let capacity = moe.capacity_factor.is_some();
    let rows: Vec<LayerRouting> = (layers.iter().zip(sums.chunks_exact(width)))
        .map(|(&layer, row)| layer_routing(layer, row, capacity))
        .collect();
    let n = rows.len().max(1) as f64;
    Ok(Some(StepRouting {
        load_balancing: rows.iter().map(|r| r.load_balancing).sum::<f64>() / n,
        z_loss: rows.iter().map(|r| r.z_loss).sum::<f64>() / n,
        max_over_mean: rows.iter().map(|r| r.max_over_mean).fold(0.0, f64::max),
        cv: rows.iter().map(|r| r.cv).fold(0.0, f64::max),
        dropped: moe
            .capacity_factor
            .map(|_| rows.iter().filter_map(|r| r.dropped).sum::<f64>() / n),
        layers: rows,
        bias_max_abs: None,
    }))
}

/// Layer `layer`'s routing from its summed row: forwards, Σ load-balancing loss, Σ z-loss,
/// dropped pairs, then the tokens of each expert; `capacity`: whether experts have one.
fn layer_routing(layer: usize, row: &[f64], capacity: bool) -> LayerRouting {
    let forwards = row[0].max(1.0);
    let tokens = &row[4..];
    let routed = tokens.iter().sum::<f64>();
    let mean = routed / tokens.len().max(1) as f64;
    let (max, min) = tokens
        .iter()
        .fold((0f64, f64::INFINITY), |(a, b), &t| (a.max(t), b.min(t)));
    let ratio = |x: f64| if mean > 0.0 { x / mean } else { 0.0 };
    let variance =
        tokens.iter().map(|t| (t - mean).powi(2)).sum::<f64>() / tokens.len().max(1) as f64;
    LayerRouting {
        layer,
        load_balancing: row[1] / forwards,
        z_loss: row[2] / forwards,
        max_over_mean: ratio(max),
        min_over_mean: ratio(min),
        cv: ratio(variance.sqrt()),
        dropped: capacity.then(|| if routed > 0.0 { row[3] / routed } else { 0.0 }),
        tokens_per_expert: tokens.to_vec(),
    }
}

/// The TensorBoard scalars of a step's routing: the means over layers, and each layer's
/// balance (`moe/layer_<l>/…`).
pub fn scalars(r: &StepRouting) -> Vec<(String, f64)> {
    let mut v = vec![
        ("moe/load_balancing".to_string(), r.load_balancing),
        ("moe/z_loss".to_string(), r.z_loss),
        ("moe/max_over_mean".to_string(), r.max_over_mean),
        ("moe/cv".to_string(), r.cv),
    ];
    v.extend(r.dropped.map(|d| ("moe/dropped".to_string(), d)));
    v.extend(r.bias_max_abs.map(|b| ("moe/bias_max_abs".to_string(), b)));
    for l in &r.layers {
        let tag = |what: &str| format!("moe/layer_{}/{what}", l.layer);
        v.extend([
            (tag("cv"), l.cv),
            (tag("max_over_mean"), l.max_over_mean),
            (tag("min_over_mean"), l.min_over_mean),
            (tag("load_balancing"), l.load_balancing),
        ]);
        v.extend(l.dropped.map(|d| (tag("dropped"), d)));
    }
    v
}

/// Auxiliary-loss-free balancing: moves each MoE layer's expert selection biases in `bias` by
/// `rate` towards balance, `bᵢ += rate · sign(mean − loadᵢ)` with the step's loads over the
/// whole job (an expert at the mean keeps its bias); returns the largest bias in magnitude.
/// Every rank computes the same update from the same counts.
pub fn update_bias(bias: &mut BTreeMap<usize, Vec<f32>>, step: &StepRouting, rate: f64) -> f64 {
    for layer in &step.layers {
        let loads = &layer.tokens_per_expert;
        let mean = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
        let b = bias
            .entry(layer.layer)
            .or_insert_with(|| vec![0.0; loads.len()]);
        for (b, &load) in b.iter_mut().zip(loads) {
            if load < mean {
                *b += rate as f32;
            } else if load > mean {
                *b -= rate as f32;
            }
        }
    }
    bias.values()
        .flatten()
        .fold(0f64, |m, &b| m.max(f64::from(b.abs())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_moves_towards_the_mean_and_keeps_experts_at_it() {
        let layer = |layer: usize, loads: &[f64]| LayerRouting {
            layer,
            load_balancing: 0.0,
            z_loss: 0.0,
            max_over_mean: 0.0,
            min_over_mean: 0.0,
            cv: 0.0,
            dropped: None,
            tokens_per_expert: loads.to_vec(),
        };
        let step = StepRouting {
            load_balancing: 0.0,
            z_loss: 0.0,
            max_over_mean: 0.0,
            cv: 0.0,
            dropped: None,
            layers: vec![
                layer(1, &[6.0, 2.0, 4.0, 4.0]),
                layer(3, &[0.0, 8.0, 4.0, 4.0]),
            ],
            bias_max_abs: None,
        };
        let mut bias = BTreeMap::from([(3, vec![0.5f32, 0.0, 0.0, -0.25])]);
        let max = update_bias(&mut bias, &step, 0.25);
        assert_eq!(bias[&1], vec![-0.25, 0.25, 0.0, 0.0]); // mean 4: over, under, at, at
        assert_eq!(bias[&3], vec![0.75, -0.25, 0.0, -0.25]);
        assert_eq!(max, 0.75);
    }

    /// A layer's balance from its summed loads: the ratios to the mean, the coefficient of
    /// variation, the dropped share of the routed pairs.
    #[test]
    fn a_layers_balance_is_read_from_its_loads() {
        // Two forwards, losses summed, 4 dropped pairs, loads 6, 2, 4, 4 (mean 4, sd sqrt 2).
        let l = layer_routing(5, &[2.0, 0.5, 0.25, 4.0, 6.0, 2.0, 4.0, 4.0], true);
        assert_eq!((l.layer, l.load_balancing, l.z_loss), (5, 0.25, 0.125));
        assert_eq!((l.max_over_mean, l.min_over_mean), (1.5, 0.5));
        assert!((l.cv - 2f64.sqrt() / 4.0).abs() < 1e-12, "{}", l.cv);
        assert_eq!(l.dropped, Some(0.25));
        // One expert takes everything: sqrt(E - 1); no tokens at all: zeros, not NaN.
        let all = layer_routing(0, &[1.0, 0.0, 0.0, 0.0, 8.0, 0.0, 0.0, 0.0], false);
        assert!((all.cv - 3f64.sqrt()).abs() < 1e-12 && all.dropped.is_none());
        let none = layer_routing(0, &[1.0, 0.0, 0.0, 0.0, 0.0, 0.0], true);
        assert_eq!(
            (none.cv, none.max_over_mean, none.dropped),
            (0.0, 0.0, Some(0.0))
        );
    }
}
