//! Helpers shared by the layout-equivalence tests: a short tiny-recipe run at a layout, and its
//! comparison with the single-rank run (tolerances in `tests/parallel.rs`).

#![allow(dead_code)]

use std::path::Path;

use pretrain::recipe::load;
use pretrain::train::{train, RunOutput};

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

/// `(max relative loss difference, max absolute weight difference, mean absolute weight
/// difference)` of `other` against `base`.
pub fn compare(name: &str, base: &RunOutput, other: &RunOutput) -> (f64, f64, f64) {
    let mut loss_diff = 0f64;
    for (a, b) in base.records.iter().zip(&other.records) {
        loss_diff = loss_diff.max((a.loss - b.loss).abs() / a.loss.abs());
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
    eprintln!("{name}: max loss rel diff {loss_diff:.2e}, weight abs diff max {w_diff:.2e} mean {mean:.2e}");
    (loss_diff, w_diff, mean)
}

/// Asserts the tolerances of `tests/parallel.rs` on a comparison's result.
pub fn assert_equivalent(layout: &str, (l, w, mean): (f64, f64, f64)) {
    assert!(l < 1e-6, "{layout}: loss differs by {l:.2e} relative");
    assert!(w < 3e-4, "{layout}: weights differ by up to {w:.2e}");
    assert!(
        mean < 2e-7,
        "{layout}: weights differ by {mean:.2e} on average"
    );
}
