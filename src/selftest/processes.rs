//! Check 7 of `pretrain selftest`: the tiny recipe trained by rank processes that the launcher
//! starts (`--nproc-per-node N`, the binary itself) against one rank in this process. On the CPU
//! two processes talk over the `tcp` backend with tensor parallelism and sequence parallelism, so
//! the activations' all-gathers and reduce-scatters, the vocabulary-parallel loss's all-reduces
//! and the gradient norm's all cross processes, on communicators created before the first step.
//! On a CUDA machine they talk over NCCL with one GPU each, in that layout and, as the GPUs allow,
//! ZeRO-1, -2 (many buckets) and -3 data parallelism (bucket all-reduces; staged reduce-scatters
//! and gathers, all in place after hand-off marks), hybrid sharding, a two-stage pipeline (1F1B
//! and zbv), the context-parallel ring, expert parallelism's all-to-all and data × tensor
//! parallelism (with one GPU the check is skipped, and the command says so: NCCL refuses two
//! ranks on one device).

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::{max_rel, tiny_overrides, Check};
use crate::recipe::DeviceKind;

/// A layout of rank processes: its name in the check, the model it trains (overrides of the tiny
/// one, also those of the one-rank run it is compared with), its overrides, its processes.
struct Layout {
    name: &'static str,
    model: &'static str,
    set: &'static str,
    procs: usize,
}

/// The tiny model as a mixture of experts (for expert parallelism's all-to-all).
pub const MOE: &str = "model.num_local_experts=4,model.num_experts_per_tok=2";

/// The layouts checked: tensor parallelism with sequence parallelism everywhere; on CUDA, as the
/// GPUs allow, every pattern of collectives and transfers the trainer issues: the communication
/// thread's in-place reductions and gathers (ZeRO-1, ZeRO-2 over many buckets, so they overlap
/// the backward, ZeRO-3), the context-parallel ring's grouped hops, the all-to-all of expert
/// parallelism, pipelines' point-to-point sends (1F1B and zbv), hybrid sharding and data with
/// tensor parallelism.
fn layouts(kind: DeviceKind, gpus: usize) -> Vec<Layout> {
    let layout = |name, model, set, procs| Layout {
        name,
        model,
        set,
        procs,
    };
    let all = [
        layout(
            "tp2 SP",
            "",
            "parallel.tp=2,parallel.sequence_parallel=true",
            2,
        ),
        layout("dp2 ZeRO-1", "", "parallel.dp=2,parallel.zero=1", 2),
        layout(
            "dp2 ZeRO-2, small buckets",
            "",
            "parallel.dp=2,parallel.zero=2,parallel.bucket_size=65536",
            2,
        ),
        layout("dp2 ZeRO-3", "", "parallel.dp=2,parallel.zero=3", 2),
        layout("pp2", "", "parallel.pp=2", 2),
        layout(
            "pp2 zbv",
            "",
            "parallel.pp=2,parallel.virtual_stages=2,parallel.schedule=zbv",
            2,
        ),
        layout("cp2 ring", "", "parallel.cp=2", 2),
        layout("ep2 all-to-all", MOE, "parallel.dp=2,parallel.ep=2", 2),
        layout(
            "dp2 x tp2 ZeRO-1",
            "",
            "parallel.dp=2,parallel.tp=2,parallel.zero=1",
            4,
        ),
        layout(
            "dp4 ZeRO-1 in shards of 2",
            "",
            "parallel.dp=4,parallel.zero=1,parallel.zero_shard_size=2,train.micro_batch=4",
            4,
        ),
    ];
    match kind {
        DeviceKind::Cpu => all.into_iter().take(1).collect(),
        DeviceKind::Cuda => all.into_iter().filter(|l| l.procs <= gpus).collect(),
    }
}

/// Check 7 on `kind` with the tiny `recipe`, against `one(model)`, the one-rank f32 losses on
/// the device of the tiny model with `model`'s overrides: one check per layout of [`layouts`];
/// none where the machine has no two GPUs.
pub fn check_processes(
    kind: DeviceKind,
    recipe: &Path,
    one: &dyn Fn(&str) -> Result<Vec<f64>>,
) -> Result<Vec<Check>> {
    let gpus = match kind {
        DeviceKind::Cpu => 0,
        DeviceKind::Cuda => crate::device::gpu_count()?,
    };
    layouts(kind, gpus)
        .iter()
        .map(|l| check_layout(kind, recipe, &one(l.model)?, l))
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
        .args(
            ["--set", layout.model]
                .iter()
                .filter(|_| !layout.model.is_empty()),
        )
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
        assert_eq!(
            two,
            [
                "tp2 SP",
                "dp2 ZeRO-1",
                "dp2 ZeRO-2, small buckets",
                "dp2 ZeRO-3",
                "pp2",
                "pp2 zbv",
                "cp2 ring",
                "ep2 all-to-all"
            ]
        );
        assert_eq!(layouts(DeviceKind::Cuda, 8).len(), 10);
        let recipe = Path::new("recipes/tiny.yaml");
        for l in layouts(DeviceKind::Cuda, 8) {
            let mut o = vec![tiny_overrides(3, "cpu", "f32"), l.set.to_string()];
            if !l.model.is_empty() {
                o.push(l.model.to_string());
            }
            let r = crate::recipe::load(recipe, &o).unwrap_or_else(|e| panic!("{}: {e}", l.name));
            assert_eq!(r.parallel.world_size(), l.procs, "{}", l.name);
        }
    }
}
