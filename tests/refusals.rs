//! What runs refuse or report instead of losing data, hanging or misleading, through the
//! binary: run files planted as links, stale locks, impossible `plan --gpus`, imports into
//! checkpoint roots, jobs over the machine's memory, failed background saves, halts on
//! non-finite steps, inputs of the wrong kind and taken ports.

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

/// Files of the run directory planted as symbolic links are never written through: a
/// linked `run.lock` is refused (its target neither shown nor truncated), linked `recipe.yaml`
/// and `loss.svg` are replaced, their targets untouched.
#[test]
fn run_files_are_not_written_through_links() {
    let tmp = tempfile::tempdir().unwrap();
    let precious = tmp.path().join("precious.txt");
    std::fs::write(&precious, "precious data").unwrap();
    let dir = tmp.path().join("run");
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink(&precious, dir.join("run.lock")).unwrap();
    let o = train(&dir, "train.steps=2");
    assert!(!o.status.success(), "{}", text(&o));
    assert_says(&o, "is a symbolic link");
    assert!(!text(&o).contains("precious data"), "{}", text(&o));
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "precious data");

    std::fs::remove_file(dir.join("run.lock")).unwrap();
    for name in ["recipe.yaml", "loss.svg"] {
        std::os::unix::fs::symlink(&precious, dir.join(name)).unwrap();
    }
    let o = train(&dir, "train.steps=2");
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "precious data");
    for name in ["recipe.yaml", "loss.svg"] {
        let meta = std::fs::symlink_metadata(dir.join(name)).unwrap();
        assert!(meta.is_file(), "{name} was replaced by a regular file");
    }
}

/// A lock file left with bytes that are not UTF-8 is taken over, its text shown
/// bounded and printable.
#[test]
fn a_garbled_stale_lock_is_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    std::fs::create_dir_all(&dir).unwrap();
    let mut garbage = vec![0xffu8, 0xfe, b'p', b'i', b'd', 0x1b];
    garbage.extend(std::iter::repeat_n(b'x', 10_000));
    std::fs::write(dir.join("run.lock"), &garbage).unwrap();
    let o = train(&dir, "train.steps=1");
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    let line = t
        .lines()
        .find(|l| l.contains("taking over the lock"))
        .unwrap();
    assert!(line.contains("??pid?x") && line.len() < 600, "{line}");
}

/// `plan --gpus` beyond the most ranks a recipe may have is refused at once (it used to
/// enumerate layouts for minutes).
#[test]
fn plan_refuses_more_gpus_than_ranks_at_once() {
    let start = std::time::Instant::now();
    let o = bin()
        .args(["plan", "--recipe", "recipes/tiny.yaml", "--gpus"])
        .arg(u64::MAX.to_string())
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert_says(&o, "exceeds 1048576");
    // As many GPUs as a layout may have, but no layout of the recipe uses them all: said, with
    // the constraints, and not an empty table.
    let o = bin()
        .args(["plan", "--recipe", "recipes/tiny.yaml", "--gpus", "1048576"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert_says(
        &o,
        "no layout of recipes/tiny.yaml runs on exactly 1048576 GPUs",
    );
    assert!(start.elapsed().as_secs() < 20, "{:?}", start.elapsed());
    let o = bin()
        .args(["plan", "--recipe", "recipes/tiny.yaml", "--gpus", "16"])
        .args(["--gpus-per-node", "3"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert_says(&o, "not a whole number of nodes of 3 GPUs");
}

/// `import-hf` never writes into a root that holds checkpoints (by default it used
/// to write into the run's own, move `latest` to step 0, and the next `resume: auto` restarted
/// the run over its steps); its default is `<run.dir>/hf-import`; the tokenizer it copies is
/// parsed at import.
#[test]
fn import_never_writes_into_a_runs_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let (run, hf) = planted::trained_and_exported(tmp.path());
    let import = |output: Option<&Path>| {
        let mut cmd = bin();
        cmd.args(["import-hf", "--model"])
            .arg(&hf)
            .args(["--recipe", "recipes/tiny.yaml", "--set"])
            .arg(format!("run.dir={}", run.display()));
        if let Some(out) = output {
            cmd.arg("--output").arg(out);
        }
        cmd.output().unwrap()
    };
    let latest = || std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    let o = import(Some(&run.join("checkpoints")));
    assert!(!o.status.success());
    assert_says(&o, "already holds checkpoints");
    assert_eq!(latest(), "step-00000002");
    let o = import(None);
    assert!(o.status.success(), "{}", text(&o));
    assert!(run.join("hf-import/step-00000000/manifest.json").exists());
    assert_eq!(latest(), "step-00000002");
    let o = import(None);
    assert_says(&o, "already holds checkpoints");

    std::fs::write(hf.join("tokenizer.json"), [7u8; 200]).unwrap();
    let o = import(Some(&tmp.path().join("fresh")));
    assert!(!o.status.success());
    assert_says(&o, "not a valid tokenizer.json");
}

/// A job whose planned memory exceeds the machine's is refused before it allocates
/// anything (it used to abort in an allocation or bring on the kernel's OOM killer); `check`
/// warns about it.
#[test]
fn jobs_larger_than_the_machine_are_refused_before_allocating() {
    let tmp = tempfile::tempdir().unwrap();
    let start = std::time::Instant::now();
    let o = train(
        &tmp.path().join("run"),
        "train.steps=3,model.vocab_size=1000000000",
    );
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("the job needs about") && t.contains("available memory (MemAvailable)"),
        "{t}"
    );
    assert!(start.elapsed().as_secs() < 10, "{:?}", start.elapsed());
    let o = bin()
        .args([
            "check",
            "--no-data",
            "--recipe",
            "recipes/tiny.yaml",
            "--set",
        ])
        .arg("model.vocab_size=1000000000")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_says(&o, "warning: the job needs about");
    // A million experts per layer: refused by name at once (`check` planned it for 20 s).
    let start = std::time::Instant::now();
    let o = bin()
        .args([
            "check",
            "--no-data",
            "--recipe",
            "recipes/tiny-moe.yaml",
            "--set",
            "model.num_local_experts=1000000",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert_says(&o, "model.num_local_experts (1000000) is above 16384");
    assert!(start.elapsed().as_secs() < 5, "{:?}", start.elapsed());
}

/// Makes `cmd`'s writes past `bytes` into one file fail with EFBIG (`RLIMIT_FSIZE`, with SIGXFSZ
/// ignored so that the process is not killed), as a full disk fails them.
fn limit_file_size(cmd: &mut Command, bytes: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A write that fails while a checkpoint copies its tokenizer names the copy, not the source it
/// was read from: the tokenizer is padded (JSON whitespace) past a file-size limit that the
/// rank's shard stays under, so the copy is the one write that fails.
#[test]
fn a_failed_tokenizer_copy_names_the_copy() {
    let tmp = tempfile::tempdir().unwrap();
    let source = tmp.path().join("tokenizer.json");
    let mut padded = std::fs::read("data/shakespeare/tokenizer.json").unwrap();
    padded.resize(padded.len() + (48 << 20), b' ');
    std::fs::write(&source, &padded).unwrap();
    let dir = tmp.path().join("run");
    let set = format!("train.steps=2,checkpoint.interval=2,data.tokenizer={source:?}");
    let mut cmd = training(&dir, &set);
    limit_file_size(&mut cmd, 40 << 20);
    let o = cmd.output().unwrap();
    assert!(!o.status.success());
    let t = text(&o);
    let copy = Path::new("checkpoints/step-00000002.tmp").join("tokenizer.json");
    assert!(
        t.contains(&*copy.to_string_lossy()) && !t.contains(&*source.to_string_lossy()),
        "{t}"
    );
    assert!(!dir.join("checkpoints/step-00000002").exists(), "{t}");
}

/// A background checkpoint write that fails is reported as the save of its own step (it
/// was reported as the save of the step that found it out). The failure is a file-size limit
/// (`RLIMIT_FSIZE`, with SIGXFSZ ignored so that the write fails with EFBIG), which the rank's
/// shard of the tiny model exceeds and the small run files do not.
#[test]
fn a_failed_background_save_names_its_step() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let mut cmd = training(
        &dir,
        "train.steps=4,checkpoint.interval=2,checkpoint.async=true",
    );
    limit_file_size(&mut cmd, 1 << 20);
    let o = cmd.output().unwrap();
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("writing the checkpoint of step 2 in the background")
            && t.contains("step-00000002.tmp")
            && !t.contains("checkpoint of step 4"),
        "{t}"
    );
}

/// R3 item 7: a resume that changes the number of steps, the learning rate, the batch or the
/// dtype is accepted and says so, key by key.
#[test]
fn resume_logs_each_changed_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let o = train(&dir, "train.steps=2,checkpoint.interval=2");
    assert!(o.status.success(), "{}", text(&o));
    let o = train(
        &dir,
        "train.steps=3,checkpoint.interval=2,checkpoint.resume=auto,optimizer.lr=0.002",
    );
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("resume: train.steps changed from 2 to 3"), "{t}");
    assert!(t.contains("resume: optimizer.lr changed from"), "{t}");
    assert!(!t.contains("resume: train.dtype"), "{t}");
}

/// Halting on a non-finite step names the checkpoint it leaves untouched, or says
/// that none was written (it claimed "the last checkpoint is untouched" with none).
#[test]
fn a_halt_says_which_checkpoint_is_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, set: &str| {
        training(&tmp.path().join(name), &format!("train.steps=4,{set}"))
            .env("PRETRAIN_TEST_NAN_GRADS", "2:0")
            .output()
            .unwrap()
    };
    let o = run("none", "checkpoint.interval=0");
    assert_says(&o, "no checkpoint has been written");
    let o = run("one", "checkpoint.interval=1");
    assert_says(&o, "the last checkpoint,");
    assert_says(&o, "step-00000001, is untouched");
}

/// A `model.safetensors` that is a directory is named as such (it was "No such
/// device"); `selftest` refuses a missing recipe or a directory as `--json` before running any
/// check; `plan` refuses hardware numbers that describe no machine.
#[test]
fn bad_arguments_are_named_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let o = train(&run, "train.steps=1,checkpoint.interval=1");
    assert!(o.status.success(), "{}", text(&o));
    let hf = tmp.path().join("hf");
    let o = bin()
        .args(["export-hf", "--checkpoint"])
        .arg(run.join("checkpoints/step-00000001"))
        .arg("--output")
        .arg(&hf)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    std::fs::remove_file(hf.join("model.safetensors")).unwrap();
    std::fs::create_dir(hf.join("model.safetensors")).unwrap();
    let o = bin()
        .args(["import-hf", "--model"])
        .arg(&hf)
        .args(["--recipe", "recipes/tiny.yaml", "--output"])
        .arg(tmp.path().join("out"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert_says(&o, "model.safetensors: not a regular file");

    let start = std::time::Instant::now();
    let o = bin()
        .args([
            "selftest",
            "--device",
            "cpu",
            "--recipe",
            "no/such/recipe.yaml",
        ])
        .output()
        .unwrap();
    assert!(
        !o.status.success() && text(&o).contains("no/such/recipe.yaml"),
        "{}",
        text(&o)
    );
    let o = bin()
        .args([
            "selftest",
            "--device",
            "cpu",
            "--recipe",
            "recipes/tiny.yaml",
            "--json",
        ])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert_says(&o, "a directory, not a file");
    assert!(start.elapsed().as_secs() < 5, "{:?}", start.elapsed());

    let o = bin()
        .args([
            "plan",
            "--recipe",
            "recipes/tiny.yaml",
            "--peak-tflops",
            "1e-300",
        ])
        .output()
        .unwrap();
    assert_says(&o, "--peak-tflops must be a number between");
}

/// Mutation check M13: rank 0 of an asynchronous save finalises only after every rank's record
/// exists — here the last rank's share is made late (`PRETRAIN_TEST_SHARE_DELAY_MS`) at dp 4 with
/// ZeRO-1, where every rank writes a shard, and every save still completes whole.
#[test]
fn asynchronous_saves_wait_for_the_last_ranks_share() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let set = "train.steps=3,parallel.dp=4,parallel.zero=1,train.global_batch=16,\
               checkpoint.interval=1,checkpoint.async=true,checkpoint.keep=5";
    let o = training(&dir, set)
        .env("PRETRAIN_TEST_SHARE_DELAY_MS", "3:400")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    for step in 1..=3 {
        let d = dir.join(format!("checkpoints/step-{step:08}"));
        let ck = ckpt::Checkpoint::open(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
        assert_eq!(ck.manifest().files.len(), 4, "{}", d.display());
    }
}

/// A `--master-port` already taken on a one-node job is refused by the launcher at
/// once, naming the flag and the loopback address (it named 0.0.0.0, and the job waited out its
/// timeout after rank 0 failed).
#[test]
fn a_taken_master_port_is_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let start = std::time::Instant::now();
    let o = training(&tmp.path().join("run"), "train.steps=2,parallel.dp=2")
        .args(["--nproc-per-node", "2", "--master-port", &port.to_string()])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains(&format!("--master-port {port}")) && t.contains(&format!("127.0.0.1:{port}")),
        "{t}"
    );
    assert!(start.elapsed().as_secs() < 10, "{:?}", start.elapsed());
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

#[path = "refusals/bounds.rs"]
mod bounds;
#[path = "refusals/planted.rs"]
mod planted;
