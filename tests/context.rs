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
        let out = run(layout);
        // The ring reports each step's time to the rank's stats sink, drained once per step.
        let ring: Vec<_> = out.records.iter().map(|r| r.time.ring_s).collect();
        assert!(
            ring.iter().all(|t| t.is_some_and(|t| t > 0.0)),
            "{layout}: {ring:?}"
        );
        results.insert(layout, compare(layout, &base, &out));
    }
    assert!(base.records.iter().all(|r| r.time.ring_s.is_none()));
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
        &[
            "parallel.cp=2,parallel.tp=4,parallel.sequence_parallel=true,train.seq_len=12"
                .to_string(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("each rank's share of a sequence (train.seq_len / parallel.cp = 12 / 2) must be divisible by parallel.tp (4)"),
        "{e}"
    );
}

/// Resume at cp 2 × dp 2 with ZeRO-1 equals the uninterrupted run bit for bit, and its checkpoint
/// continues the same curve at cp = 1 (layout-free checkpoints: weights are replicated over cp).
#[test]
fn a_context_parallel_checkpoint_resumes_exactly_and_continues_at_one_rank() {
    use pretrain::train::{train, RunOutput};
    let run_in = |dir: &Path, extra: &[String]| -> RunOutput {
        let mut o = vec![format!(
            "train.steps=6,schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,train.micro_batch=4,run.dir={}",
            dir.display()
        )];
        o.extend(extra.iter().cloned());
        let recipe = load(Path::new("recipes/tiny.yaml"), &o).unwrap();
        train(recipe, true).unwrap_or_else(|e| panic!("{extra:?}: {e:#}"))
    };
    let layout = "parallel.cp=2,parallel.dp=2,parallel.zero=1".to_string();
    let tmp = tempfile::tempdir().unwrap();
    let full = run_in(
        &tmp.path().join("a"),
        &[layout.clone(), "checkpoint.interval=3".into()],
    );
    let step3 = tmp.path().join("a/checkpoints/step-00000003");
    let resume = format!("checkpoint.resume={}", step3.display());
    let resumed = run_in(&tmp.path().join("b"), &[layout, resume.clone()]);
    let losses = |r: &RunOutput| {
        r.records
            .iter()
            .map(|r| (r.step, r.loss))
            .collect::<Vec<_>>()
    };
    assert_eq!(losses(&resumed), losses(&full)[3..].to_vec());
    assert_eq!(resumed.weights, full.weights, "final weights after resume");

    let single = run_in(&tmp.path().join("c"), &["parallel.cp=1".into(), resume]);
    for (a, b) in losses(&single).iter().zip(&losses(&full)[3..]) {
        assert_eq!(a.0, b.0);
        assert!(
            (a.1 - b.1).abs() / b.1 < 1e-6,
            "step {}: {} vs {}",
            a.0,
            a.1,
            b.1
        );
    }
}
