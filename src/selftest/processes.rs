//! Check 7 of `pretrain selftest`: the tiny recipe trained by rank processes that the launcher
//! starts (`--nproc-per-node N`, the binary itself) against one rank in this process. On the CPU
//! two processes talk over the `tcp` backend with tensor parallelism and sequence parallelism, so
//! the activations' all-gathers and reduce-scatters, the vocabulary-parallel loss's all-reduces
//! and the gradient norm's all cross processes, on communicators created before the first step.
//! On a CUDA machine they talk over NCCL with one GPU each, in that layout and, as the GPUs allow,
//! ZeRO-1 and ZeRO-3 data parallelism (bucket all-reduces; staged reduce-scatters and gathers, all
//! in place after hand-off marks), a two-stage pipeline and data × tensor parallelism (with one
//! GPU the check is skipped, and the command says so: NCCL refuses two ranks on one device).

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::{max_rel, tiny_overrides, Check};
use crate::recipe::DeviceKind;

/// A layout of rank processes: its name in the check, its overrides, its processes.
struct Layout {
    name: &'static str,
    set: &'static str,
    procs: usize,
}

/// The layouts checked: tensor parallelism with sequence parallelism everywhere; on CUDA, as the
/// GPUs allow, ZeRO-1 and ZeRO-3 data parallelism (the communication thread's in-place
/// reductions and gathers), a two-stage pipeline (point-to-point sends) and data with tensor
/// parallelism.
fn layouts(kind: DeviceKind, gpus: usize) -> Vec<Layout> {
    let all = [
        Layout {
            name: "tp2 SP",
            set: "parallel.tp=2,parallel.sequence_parallel=true",
            procs: 2,
        },
        Layout {
            name: "dp2 ZeRO-1",
            set: "parallel.dp=2,parallel.zero=1",
            procs: 2,
        },
        Layout {
            name: "dp2 ZeRO-3",
            set: "parallel.dp=2,parallel.zero=3",
            procs: 2,
        },
        Layout {
            name: "pp2",
            set: "parallel.pp=2",
            procs: 2,
        },
        Layout {
            name: "dp2 x tp2 ZeRO-1",
            set: "parallel.dp=2,parallel.tp=2,parallel.zero=1",
            procs: 4,
        },
    ];
    match kind {
        DeviceKind::Cpu => all.into_iter().take(1).collect(),
        DeviceKind::Cuda => all.into_iter().filter(|l| l.procs <= gpus).collect(),
    }
}

/// Check 7 on `kind` with the tiny `recipe`, against `one`, the one-rank f32 losses on the
/// device: one check per layout of [`layouts`]; none where the machine has no two GPUs.
pub fn check_processes(kind: DeviceKind, recipe: &Path, one: &[f64]) -> Result<Vec<Check>> {
    let gpus = match kind {
        DeviceKind::Cpu => 0,
        DeviceKind::Cuda => crate::device::gpu_count()?,
    };
    layouts(kind, gpus)
        .iter()
        .map(|l| check_layout(kind, recipe, one, l))
        .collect()
}

fn check_layout(kind: DeviceKind, recipe: &Path, one: &[f64], layout: &Layout) -> Result<Check> {
    let (dev, backend) = match kind {
        DeviceKind::Cpu => ("cpu", "tcp"),
        DeviceKind::Cuda => ("cuda", "NCCL"),
    };
    let dir = std::env::temp_dir().join(format!("pretrain-selftest-{}", std::process::id()));
    let exe = std::env::current_exe().context("finding this binary to start rank processes")?;
    let out = Command::new(exe)
        .args(["--nproc-per-node", &layout.procs.to_string(), "--recipe"])
        .arg(recipe)
        .args(["--set", &tiny_overrides(3, dev, "f32"), "--set", layout.set])
        .arg("--set")
        .arg(format!("run.dir={}", dir.display()))
        .output()
        .context("starting rank processes")?;
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl"));
    let _ = std::fs::remove_dir_all(&dir);
    let what = format!(
        "{} rank processes ({}) over {backend}",
        layout.procs, layout.name
    );
    if !out.status.success() {
        let log = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!("{what} failed ({}):\n{}", out.status, tail.join("\n"));
    }
    let metrics = metrics.with_context(|| format!("reading the metrics.jsonl of {what}"))?;
    let records: Vec<serde_json::Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let many: Vec<f64> = records
        .iter()
        .filter_map(|v| v.get("loss")?.as_f64())
        .collect();
    // With NCCL, what its communicators' buffers add to the context and libraries: the figure
    // the planner's headroom stands for (`pretrain plan`, context_gib and nccl_gib).
    let outside = records
        .iter()
        .filter_map(|v| v.get("device_outside_pool_mib")?.as_f64())
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
    if let Some(mib) = outside {
        eprintln!(
            "selftest: {what}: {mib:.0} MiB of device memory in use outside the pool (rank 0)"
        );
    }
    if many.len() != one.len() {
        bail!(
            "{what} reported {} losses, one rank {}",
            many.len(),
            one.len()
        );
    }
    Ok(Check {
        name: format!(
            "{} rank processes over {backend} on {dev} vs one rank (loss)",
            layout.name
        ),
        error: max_rel(&many, one),
        tolerance: 1e-5,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_grow_with_the_gpus_and_every_one_is_valid() {
        assert_eq!(layouts(DeviceKind::Cpu, 0).len(), 1);
        assert!(layouts(DeviceKind::Cuda, 1).is_empty());
        let two: Vec<&str> = layouts(DeviceKind::Cuda, 2)
            .iter()
            .map(|l| l.name)
            .collect();
        assert_eq!(two, ["tp2 SP", "dp2 ZeRO-1", "dp2 ZeRO-3", "pp2"]);
        assert_eq!(layouts(DeviceKind::Cuda, 8).len(), 5);
        let recipe = Path::new("recipes/tiny.yaml");
        for l in layouts(DeviceKind::Cuda, 8) {
            let o = vec![tiny_overrides(3, "cpu", "f32"), l.set.to_string()];
            let r = crate::recipe::load(recipe, &o).unwrap_or_else(|e| panic!("{}: {e}", l.name));
            assert_eq!(r.parallel.world_size(), l.procs, "{}", l.name);
        }
    }
}
