//! `pretrain --recipe R --gpus N`: the recipe's model, sequence, global batch and optimizer on N
//! devices of the kind found here, in the layout the planner ranks best for them
//! (`plan::choose`, which elastic restarts share), as overrides added to the recipe's.

use anyhow::{bail, Result};

use super::{LaunchArgs, RecipeArgs};
use crate::plan::choose::{choose, nodes_of, smallest_fit, Keep};
use crate::plan::{Hardware, Layout};
use crate::recipe::{DeviceKind, Recipe};

/// The recipe arguments and launcher options of a run on `n` devices: the chosen layout's
/// overrides appended to `args` (what rank processes are started with, and what the resolved
/// `recipe.yaml` records), and on CUDA without `--nproc-per-node` one rank process per GPU.
/// Logs what the recipe asked and what runs instead, and why (once per job).
pub(super) fn resolve(
    args: &RecipeArgs,
    launch: &LaunchArgs,
    recipe: &Recipe,
    n: usize,
) -> Result<(RecipeArgs, LaunchArgs, Recipe)> {
    if n == 0 {
        bail!("--gpus 0: a job needs at least one device");
    }
    if launch.elastic.is_some() {
        bail!(
            "--gpus with --elastic: the elastic launcher lays the recipe out for the ranks present \
             (the same choice --gpus makes); give one of the two"
        );
    }
    let mut launch = launch.clone();
    let per_node = match launch.nproc_per_node {
        Some(p) if p * launch.nnodes != n => bail!(
            "--gpus {n} with --nproc-per-node {p} --nnodes {}: the job has {} devices; give \
             --gpus {} or leave it out",
            launch.nnodes,
            p * launch.nnodes,
            p * launch.nnodes
        ),
        Some(p) => p,
        None => {
            let launched = parallel::env::from_env(&|k| std::env::var(k).ok())?;
            if let Some(info) = launched.filter(|i| i.world_size > 1) {
                // A rank of a job torchrun or Slurm started: every rank chooses alike, for the
                // job's nodes of LOCAL_WORLD_SIZE ranks.
                if info.world_size != n {
                    bail!(
                        "--gpus {n} in a job of {} processes (WORLD_SIZE): give --gpus {}",
                        info.world_size,
                        info.world_size
                    );
                }
                let local = std::env::var("LOCAL_WORLD_SIZE").ok();
                let per_node = local.and_then(|v| v.trim().parse().ok()).unwrap_or(n);
                return finish(args, launch.clone(), recipe, n, per_node);
            }
            if recipe.train.device == DeviceKind::Cuda && n > 1 {
                // A rank process per GPU, as --nproc-per-node N starts them.
                launch.nproc_per_node = Some(n);
            }
            n
        }
    };
    finish(args, launch, recipe, n, per_node)
}

/// [`resolve`] once the devices are known: `n` of them, `per_node` to a node.
fn finish(
    args: &RecipeArgs,
    launch: LaunchArgs,
    recipe: &Recipe,
    n: usize,
    per_node: usize,
) -> Result<(RecipeArgs, LaunchArgs, Recipe)> {
    let hw = Hardware::found(recipe, per_node);
    let nodes = nodes_of(n, per_node);
    let Some(choice) = choose(recipe, &nodes, n, &hw, Keep::Run) else {
        let fewest = match smallest_fit(recipe, &hw, Keep::Run, n) {
            Some(m) => format!("the fewest that fit: --gpus {m}"),
            None => "none up to 4096 does".to_string(),
        };
        bail!(
            "--gpus {n}: no layout of {} uses {n} devices ({} of {:.1} GiB{}) within their memory \
             and the trainer's limits, keeping its model, sequence, global batch and optimizer; \
             {fewest}",
            args.recipe.display(),
            hw.name,
            hw.memory_gib,
            if hw.is_gpu() {
                ""
            } else {
                " of host memory each"
            }
        );
    };
    let asked = Layout::of(recipe);
    let mut resolved = args.clone();
    resolved.overrides.push(choice.overrides());
    let chosen = resolved.load()?;
    let first = ["RANK", "SLURM_PROCID"]
        .iter()
        .all(|v| std::env::var(v).map_or(true, |r| r.trim() == "0"));
    if first {
        let why = choice.reason(&hw);
        if choice.own {
            tracing::info!(
                "--gpus {n}: the recipe's own layout ({asked}, {} ranks): {why}",
                recipe.parallel.world_size()
            );
        } else {
            tracing::info!(
                "--gpus {n}: the recipe asks for {asked} on {} ranks; running {} on {} ranks \
                 instead: {why}",
                recipe.parallel.world_size(),
                choice.layout,
                choice.world
            );
        }
    }
    Ok((resolved, launch, chosen))
}
