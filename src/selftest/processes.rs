//! Check 7 of `pretrain selftest`: the tiny recipe trained by two rank processes that the launcher
//! starts (`--nproc-per-node 2`, the binary itself) against one rank in this process. On the CPU
//! the processes talk over the `tcp` backend; on a CUDA machine with at least two GPUs, over NCCL
//! with one GPU each (with one GPU the check is skipped, and the command says so: NCCL refuses
//! two ranks on one device). The layout is tensor parallelism with sequence parallelism, so the
//! activations' all-gathers and reduce-scatters, the vocabulary-parallel loss's all-reduces and
//! the gradient norm's all cross processes, on communicators created before the first step.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::{max_rel, tiny_overrides, Check};
use crate::recipe::DeviceKind;

/// The two processes' layout.
const LAYOUT: &str = "parallel.tp=2,parallel.sequence_parallel=true";

/// Check 7 on `kind` with the tiny `recipe`, against `one`, the one-rank f32 losses on the
/// device; `None` where the machine has no two GPUs.
pub fn check_processes(kind: DeviceKind, recipe: &Path, one: &[f64]) -> Result<Option<Check>> {
    let (dev, backend) = match kind {
        DeviceKind::Cpu => ("cpu", "tcp"),
        DeviceKind::Cuda => ("cuda", "NCCL"),
    };
    if kind == DeviceKind::Cuda && crate::device::gpu_count()? < 2 {
        return Ok(None);
    }
    let dir = std::env::temp_dir().join(format!("pretrain-selftest-{}", std::process::id()));
    let exe = std::env::current_exe().context("finding this binary to start rank processes")?;
    let out = Command::new(exe)
        .args(["--nproc-per-node", "2", "--recipe"])
        .arg(recipe)
        .args(["--set", &tiny_overrides(3, dev, "f32"), "--set", LAYOUT])
        .arg("--set")
        .arg(format!("run.dir={}", dir.display()))
        .output()
        .context("starting two rank processes")?;
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl"));
    let _ = std::fs::remove_dir_all(&dir);
    if !out.status.success() {
        let log = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "two rank processes over {backend} failed ({}):\n{}",
            out.status,
            tail.join("\n")
        );
    }
    let metrics = metrics.context("reading the rank processes' metrics.jsonl")?;
    let two: Vec<f64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("loss")?.as_f64())
        .collect();
    if two.len() != one.len() {
        bail!(
            "two rank processes over {backend} reported {} losses, one rank {}",
            two.len(),
            one.len()
        );
    }
    Ok(Some(Check {
        name: format!("tp2 SP rank processes over {backend} on {dev} vs one rank (loss)"),
        error: max_rel(&two, one),
        tolerance: 1e-5,
    }))
}
