//! Names another user can plant where a run, a checkpoint or a dataset keeps its files: a
//! symbolic link is never written through, and a FIFO never blocks the command. Each is refused
//! at once, naming the file, or replaced by rename.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{assert_says, bin, text, train, training};

/// Makes a FIFO at `path`.
fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "{path:?}");
}

/// `cmd`'s output, killed when it runs past `secs` (a blocked open would hang the suite).
fn within(cmd: &mut Command, secs: u64) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(secs) {
            child.kill().unwrap();
            let o = child.wait_with_output().unwrap();
            panic!("still running after {secs} s:\n{}", text(&o));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// A tiny run of 2 steps under `dir` (`dir/run`, saved at step 2) and its Hugging Face export
/// (`dir/hf`).
pub(super) fn trained_and_exported(dir: &Path) -> (PathBuf, PathBuf) {
    let run = dir.join("run");
    let o = train(&run, "train.steps=2,checkpoint.interval=2");
    assert!(o.status.success(), "{}", text(&o));
    let hf = dir.join("hf");
    let o = bin()
        .args(["export-hf", "--checkpoint"])
        .arg(run.join("checkpoints/step-00000002"))
        .arg("--output")
        .arg(&hf)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    (run, hf)
}

/// Asserts that `o` failed, saying that `file` is not a regular file.
#[track_caller]
fn refused_as_not_regular(o: &Output, file: &Path) {
    assert!(!o.status.success(), "{}", text(o));
    assert_says(o, "not a regular file");
    assert_says(o, &file.display().to_string());
}

#[test]
fn a_flight_record_planted_as_a_link_is_refused_and_its_target_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, "precious data").unwrap();
    let dir = tmp.path().join("run");
    std::fs::create_dir_all(dir.join("flight")).unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("flight/rank-00000.flight")).unwrap();
    let o = train(&dir, "train.steps=2");
    assert!(!o.status.success(), "{}", text(&o));
    assert_says(&o, "rank-00000.flight is a symbolic link");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious data");
}

#[test]
fn fifos_in_place_of_run_files_are_refused_at_once() {
    for name in ["metrics.jsonl", "flight/rank-00000.flight"] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let fifo = dir.join(name);
        std::fs::create_dir_all(fifo.parent().unwrap()).unwrap();
        mkfifo(&fifo);
        let o = within(&mut training(&dir, "train.steps=2"), 60);
        refused_as_not_regular(&o, &fifo);
    }
}

#[test]
fn a_fifo_in_place_of_the_trace_is_replaced_not_written_into() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    std::fs::create_dir_all(&dir).unwrap();
    mkfifo(&dir.join("trace.json"));
    let o = within(&mut training(&dir, "train.steps=2,run.trace_step=2"), 60);
    assert!(o.status.success(), "{}", text(&o));
    let meta = std::fs::symlink_metadata(dir.join("trace.json")).unwrap();
    assert!(meta.is_file(), "trace.json is a regular file now");
}

#[test]
fn fifos_in_a_checkpoint_are_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let o = train(&dir, "train.steps=2,checkpoint.interval=2");
    assert!(o.status.success(), "{}", text(&o));
    let root = dir.join("checkpoints");
    let resume = "train.steps=4,checkpoint.interval=2,checkpoint.resume=auto";
    // `latest`, then the step's manifest, then one of its shards.
    let step = root.join("step-00000002");
    for file in [
        root.join("latest"),
        step.join("manifest.json"),
        step.join("rank-00000.safetensors"),
        step.join("tokenizer.json"),
    ] {
        let kept = std::fs::read(&file).unwrap();
        std::fs::remove_file(&file).unwrap();
        mkfifo(&file);
        let o = within(&mut training(&dir, resume), 60);
        refused_as_not_regular(&o, &file);
        std::fs::remove_file(&file).unwrap();
        std::fs::write(&file, kept).unwrap();
    }
}

#[test]
fn a_fifo_in_place_of_a_dataset_index_is_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("corpus");
    let idx = tmp.path().join("corpus.idx");
    mkfifo(&idx);
    std::fs::write(tmp.path().join("corpus.bin"), b"").unwrap();
    let set = format!(
        "train.steps=2,data.datasets=[{{prefix: {}}}]",
        prefix.display()
    );
    let o = within(&mut training(&tmp.path().join("run"), &set), 60);
    refused_as_not_regular(&o, &idx);
}

#[test]
fn fifos_in_a_hugging_face_model_are_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, hf) = trained_and_exported(tmp.path());
    for (k, name) in ["tokenizer.json", "model.safetensors"].iter().enumerate() {
        let file = hf.join(name);
        let kept = std::fs::read(&file).unwrap();
        std::fs::remove_file(&file).unwrap();
        mkfifo(&file);
        let mut cmd = bin();
        cmd.args(["import-hf", "--model"])
            .arg(&hf)
            .args(["--recipe", "recipes/tiny.yaml", "--output"])
            .arg(tmp.path().join(format!("import-{k}")));
        refused_as_not_regular(&within(&mut cmd, 60), &file);
        std::fs::remove_file(&file).unwrap();
        std::fs::write(&file, kept).unwrap();
    }
}
