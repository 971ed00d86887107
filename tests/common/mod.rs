//! Helpers shared by the layout-equivalence tests: a short tiny-recipe run at a layout, and its
//! comparison with the single-rank run (tolerances in `tests/parallel.rs`).

#![allow(dead_code)]

use std::path::Path;

use pretrain::recipe::load;
use pretrain::train::{train, RunOutput};

pub mod cli;
pub mod hf;
pub mod job;
pub mod reference;
pub mod short;
pub mod small;

/// Trains the tiny recipe for 3 steps (global batch 16, micro-batch 4) at `layout` (recipe
/// overrides), as threads, without writing outputs.
pub fn run(layout: &str) -> RunOutput {
    let o = vec![
        "train.steps=3,schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,train.micro_batch=4".to_string(),
        layout.to_string(),
    ];
    let recipe = load(Path::new("recipes/tiny.yaml"), &o).unwrap();
    train(recipe, false).unwrap_or_else(|e| panic!("{layout}: {e:#}"))
}

/// How far a layout's run is from the single-rank run.
#[derive(Debug, Clone, Copy)]
pub struct Distance {
    /// Largest relative difference of a step's loss.
    pub loss: f64,
    /// Relative difference of the first step's reported gradient norm (same weights on both
    /// sides: only the order of the sums differs).
    pub grad_norm_first: f64,
    /// Largest relative difference of a step's reported gradient norm.
    pub grad_norm: f64,
    /// Largest absolute difference of a final weight.
    pub weight_max: f64,
    /// Mean absolute difference of the final weights.
    pub weight_mean: f64,
}

/// The [`Distance`] of `other` from `base`.
pub fn compare(name: &str, base: &RunOutput, other: &RunOutput) -> Distance {
    let (mut loss_diff, mut norm_diff) = (0f64, 0f64);
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs();
    let norm_first = rel(base.records[0].grad_norm, other.records[0].grad_norm);
    for (a, b) in base.records.iter().zip(&other.records) {
        loss_diff = loss_diff.max((a.loss - b.loss).abs() / a.loss.abs());
        norm_diff = norm_diff.max(rel(a.grad_norm, b.grad_norm));
    }
    assert_eq!(base.records.len(), other.records.len());
    let (mut w_diff, mut sum, mut count) = (0f64, 0f64, 0usize);
    assert_eq!(
        base.weights.keys().collect::<Vec<_>>(),
        other.weights.keys().collect::<Vec<_>>(),
        "{name}"
    );
    for (k, a) in &base.weights {
        let b = &other.weights[k];
        let mut d = 0f64;
        for (x, y) in a.iter().zip(b) {
            d = d.max((x - y).abs() as f64);
            sum += (x - y).abs() as f64;
        }
        count += a.len();
        if std::env::var_os("PARALLEL_DEBUG").is_some() {
            eprintln!("  {k}: {d:.2e}");
        }
        w_diff = w_diff.max(d);
    }
    let mean = sum / count as f64;
    eprintln!("{name}: max loss rel diff {loss_diff:.2e}, grad norm rel diff {norm_first:.2e} at step 1, {norm_diff:.2e} at most, weight abs diff max {w_diff:.2e} mean {mean:.2e}");
    Distance {
        loss: loss_diff,
        grad_norm_first: norm_first,
        grad_norm: norm_diff,
        weight_max: w_diff,
        weight_mean: mean,
    }
}

/// Asserts the tolerances of `tests/parallel.rs` on a comparison's result.
pub fn assert_equivalent(layout: &str, d: Distance) {
    let (l, w, mean) = (d.loss, d.weight_max, d.weight_mean);
    assert!(l < 1e-6, "{layout}: loss differs by {l:.2e} relative");
    assert!(
        d.grad_norm_first < 1e-6 && d.grad_norm < 1e-4,
        "{layout}: the reported gradient norm differs by {:.2e} relative at step 1, {:.2e} at most",
        d.grad_norm_first,
        d.grad_norm
    );
    assert!(w < 3e-4, "{layout}: weights differ by up to {w:.2e}");
    assert!(
        mean < 2e-7,
        "{layout}: weights differ by {mean:.2e} on average"
    );
}

/// The tiny recipe as a mixture of experts: 4 experts of width 192, top-2, both router losses on.
pub const MOE: &str = "model.num_local_experts=4,model.num_experts_per_tok=2,model.intermediate_size=192,model.router_z_loss_coef=0.001";

/// Where a layout's reported routing (each step's load-balancing loss and busiest expert)
/// differs from the base run's by more than 1e-6 relative.
pub fn routing_differences(
    layout: &str,
    base: &pretrain::train::RunOutput,
    other: &pretrain::train::RunOutput,
) -> Vec<String> {
    let routing = |r: &pretrain::train::RunOutput| -> Vec<(f64, f64)> {
        r.records
            .iter()
            .map(|s| {
                let m = s.moe.as_ref().expect("a MoE step reports its routing");
                (m.load_balancing, m.max_over_mean)
            })
            .collect()
    };
    routing(base)
        .into_iter()
        .zip(routing(other))
        .filter(|((a, b), (c, e))| (a - c).abs() > 1e-6 * a || (b - e).abs() > 1e-6 * b)
        .map(|((a, b), (c, e))| format!("{layout}: routing {a} {b} vs {c} {e}"))
        .collect()
}
