//! Crash consistency: the trainer is killed with SIGKILL several times, during training and in the
//! middle of writing a checkpoint (synchronously, or on the background writer of
//! `checkpoint.async` while training goes on); each restart with `checkpoint.resume=auto`
//! continues from the newest complete checkpoint, and the run ends bit-identical to one that was
//! never interrupted.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

mod common;
use common::short::masters;

const STEPS: usize = 8;

/// Runs the trainer in `dir`; if `kill_at` is given, sends SIGKILL as soon as a log line contains
/// it. Returns whether the process was killed.
fn run(dir: &Path, kill_at: Option<&str>, pause_in_save: bool, asynchronous: bool) -> bool {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pretrain"));
    cmd.args(["--recipe", "recipes/tiny.yaml", "--set"])
        .arg(format!(
            "train.steps={STEPS},schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,train.micro_batch=4,\
             run.log_interval=1,checkpoint.interval=2,checkpoint.keep=10,checkpoint.resume=auto,run.dir={},\
             checkpoint.async={asynchronous}",
            dir.display()
        ))
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if pause_in_save {
        cmd.env("PRETRAIN_TEST_SAVE_PAUSE_MS", "60000");
    }
    let mut child = cmd.spawn().unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let mut killed = false;
    for line in out.lines() {
        let line = line.unwrap();
        if kill_at.is_some_and(|k| line.contains(k)) {
            child.kill().unwrap(); // SIGKILL
            killed = true;
            break;
        }
    }
    let status = child.wait().unwrap();
    assert!(killed || status.success(), "trainer failed: {status}");
    killed
}

/// Loss of each step (the last record of a step wins: a resumed run repeats steps after its checkpoint).
fn losses(dir: &Path) -> BTreeMap<u64, f64> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| Some((v["step"].as_u64()?, v.get("loss")?.as_f64()?)))
        .collect()
}

#[test]
fn sigkill_during_training_and_saving_then_resume_auto_matches_the_uninterrupted_run() {
    crash_and_resume(false);
}

#[test]
fn sigkill_during_an_asynchronous_save_then_resume_auto_matches_the_uninterrupted_run() {
    crash_and_resume(true);
}

fn crash_and_resume(asynchronous: bool) {
    let run = |dir: &Path, kill_at, pause| run(dir, kill_at, pause, asynchronous);
    let tmp = tempfile::tempdir().unwrap();
    let (clean, crashed) = (tmp.path().join("clean"), tmp.path().join("crashed"));
    // The reference is always saved synchronously.
    assert!(!self::run(&clean, None, false, false));

    // 1. Killed while training step 3 (checkpoint 2 complete).
    assert!(run(&crashed, Some("step=3/"), false));
    // 2. Killed inside the save of step 4: shards written, no manifest yet.
    assert!(run(
        &crashed,
        Some("checkpoint step 4: shards written"),
        true
    ));
    assert!(crashed.join("checkpoints/step-00000004.tmp").exists());
    assert!(!crashed.join("checkpoints/step-00000004").exists());
    // 3. Resumes from step 2 (never the half-written step 4) and is killed during step 6.
    assert!(run(&crashed, Some("step=6/"), false));
    // 4. Killed again inside the save of step 6.
    assert!(run(
        &crashed,
        Some("checkpoint step 6: shards written"),
        true
    ));
    // 5. Runs to the end.
    assert!(!run(&crashed, None, false));

    let final_dir = format!("checkpoints/step-{STEPS:08}");
    assert_eq!(losses(&crashed), losses(&clean), "per-step losses");
    assert_eq!(losses(&clean).len(), STEPS);
    assert_eq!(
        masters(&crashed.join(&final_dir)),
        masters(&clean.join(&final_dir)),
        "final weights"
    );
    assert!(
        !crashed.join("checkpoints/step-00000004.tmp").exists(),
        "stale temporary directories are cleaned"
    );
}
