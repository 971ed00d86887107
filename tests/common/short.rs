//! The binary's short runs of the tiny recipe (global batch 8, a log line per step, no
//! validation) and what they leave: shared by the failure and resume tests.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

/// Overrides of every short run.
pub const BASE: &str = "schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=8,\
                    train.micro_batch=4,run.log_interval=1";

/// The binary training the tiny recipe into `dir` with [`BASE`] and `set`.
pub fn pretrain(dir: &Path, set: &str) -> Command {
    super::cli::tiny(dir, BASE, set)
}

/// Runs `cmd` to its end.
pub fn output(mut cmd: Command) -> Output {
    cmd.output().unwrap()
}

/// Each step's loss in `metrics.jsonl`, asserting that no step appears twice.
pub fn losses(dir: &Path) -> BTreeMap<u64, f64> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let mut out = BTreeMap::new();
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        let step = v["step"].as_u64().unwrap();
        assert!(
            out.insert(step, v["loss"].as_f64().unwrap()).is_none(),
            "step {step} twice"
        );
    }
    out
}

/// What a finished command wrote to stderr.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Starts `cmd` and returns it once a log line contains `line` (the lines are drained after).
pub fn start_until(mut cmd: Command, line: &str) -> Child {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        match out.next() {
            Some(l) if l.as_ref().unwrap().contains(line) => break,
            Some(_) => {}
            None => panic!("the run ended before logging {line:?}"),
        }
    }
    std::thread::spawn(move || out.for_each(drop));
    child
}

/// Every tensor's master weights in the checkpoint `step_dir`, in the manifest's order.
pub fn masters(step_dir: &Path) -> Vec<Vec<f32>> {
    let ck = ckpt::Checkpoint::open(step_dir).unwrap();
    ck.tensors()
        .iter()
        .map(|(name, shape)| ck.read_tensor(name, ckpt::Kind::Master, shape).unwrap())
        .collect()
}

/// The names of the step directories (`step-…`) under `run`'s `checkpoints`.
pub fn step_dirs(run: &Path) -> Vec<String> {
    std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect()
}
