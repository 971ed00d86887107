//! Context parallelism trains like one rank: each sequence split over cp thread-ranks (two chunks
//! each), attention as a ring, gradients reduced over dp × cp, composed with tensor + sequence
//! parallelism, data parallelism with ZeRO, pipelines and recompute. Loss curves and final weights
//! are held to `tests/parallel.rs`'s tolerances (the ring merges attention blocks by their
//! log-sum-exp and the loss sums over cp ranks: f32 rounding only). Validation and `eval` run at
//! cp > 1 and agree with one rank.

use std::collections::BTreeMap;
use std::path::Path;

use pretrain::recipe::load;

mod common;
use common::{assert_equivalent, compare, run};

#[test]
fn context_parallel_layouts_equal_the_single_rank_run() {
    let base = run("parallel.dp=1");
    let mut results = BTreeMap::new();
    for layout in [
        "parallel.cp=2",
        "parallel.cp=4",
        "parallel.cp=2,parallel.tp=2,parallel.sequence_parallel=true",
        "parallel.cp=2,parallel.dp=2,parallel.zero=1",
        "parallel.cp=2,parallel.dp=2,parallel.zero=3,train.recompute=full",
        "parallel.cp=2,parallel.pp=2",
        "parallel.cp=2,parallel.pp=2,parallel.virtual_stages=2,train.recompute=full",
    ] {
        results.insert(layout, compare(layout, &base, &run(layout)));
    }
    for (layout, result) in results {
        assert_equivalent(layout, result);
    }
}

#[test]
fn a_sequence_that_does_not_split_into_two_chunks_per_rank_is_refused_by_field() {
    let e = load(
        Path::new("recipes/tiny.yaml"),
        &["parallel.cp=3".to_string()],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("parallel.cp (3)") && e.contains("train.seq_len (128) must be divisible by 6"),
        "{e}"
    );
    let e = load(
        Path::new("recipes/tiny.yaml"),
        &["parallel.cp=2,train.device=cuda".to_string()],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("not available on train.device: cuda"), "{e}");
}
