//! Regression tests of the 2026-11-27 probe's defects in what runs write and read, through the
//! binary.

use std::path::Path;
use std::process::{Command, Output};

mod common;
use common::cli::{assert_says, bin, text};

const BASE: &str = "schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=8,\
                    train.micro_batch=4,run.log_interval=1";

/// A tiny training run in `dir` with the overrides `set`, to run.
fn training(dir: &Path, set: &str) -> Command {
    let mut cmd = bin();
    cmd.args(["--recipe", "recipes/tiny.yaml", "--set"])
        .arg(format!("{BASE},run.dir={},{set}", dir.display()));
    cmd
}

fn train(dir: &Path, set: &str) -> Output {
    training(dir, set).output().unwrap()
}

/// A run from step 0 into a run directory that holds another run's checkpoints is refused
/// before it writes anything (it replaced their `latest`, saved over their steps and cut their
/// metrics short); `checkpoint.resume=auto` continues them.
#[test]
fn a_fresh_run_never_saves_over_an_earlier_runs_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let o = train(&dir, "train.steps=4,checkpoint.interval=2");
    assert!(o.status.success(), "{}", text(&o));
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
    let before = (
        read("metrics.jsonl"),
        read("recipe.yaml"),
        read("checkpoints/latest"),
        read("checkpoints/step-00000002/manifest.json"),
    );
    let o = train(&dir, "train.steps=2,checkpoint.interval=2,train.seed=99");
    assert!(!o.status.success(), "{}", text(&o));
    assert_says(
        &o,
        "holds checkpoints of an earlier run (the newest of step 4)",
    );
    assert_says(&o, "checkpoint.resume=auto");
    let after = (
        read("metrics.jsonl"),
        read("recipe.yaml"),
        read("checkpoints/latest"),
        read("checkpoints/step-00000002/manifest.json"),
    );
    assert!(before == after, "the earlier run's files changed");

    let o = train(
        &dir,
        "train.steps=6,checkpoint.interval=2,checkpoint.resume=auto",
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_says(&o, "step=6/6");
}

/// A checkpoint root given where a step directory belongs is named as such, with its newest
/// step directory (it was "incomplete checkpoint (no manifest.json)").
#[test]
fn a_checkpoint_root_given_for_a_step_directory_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let o = train(&dir, "train.steps=2,checkpoint.interval=2");
    assert!(o.status.success(), "{}", text(&o));
    let input = tmp.path().join("text.txt");
    std::fs::write(
        &input,
        "To be, or not to be, that is the question. ".repeat(200),
    )
    .unwrap();
    let o = bin()
        .args(["eval", "--checkpoint"])
        .arg(dir.join("checkpoints"))
        .arg("--input")
        .arg(&input)
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert_says(&o, "a checkpoint root, not a step directory");
    assert_says(&o, "step-00000002");
}
