//! `pretrain --recipe ...`: training from a recipe as thread ranks in this process, as the rank
//! processes `--nproc-per-node` starts (plainly or elastically), or as one rank of a job that
//! torchrun or Slurm started (joining it, with the exit deadline and the flight recorder).

use std::ffi::OsString;
use std::time::Duration;

use anyhow::Result;
use tracing::info;

use super::{LaunchArgs, RecipeArgs};

pub(super) fn train(args: &RecipeArgs, launch: &LaunchArgs) -> Result<()> {
    let recipe = args.load()?;
    let (args, launch, recipe) = match launch.gpus {
        Some(n) => super::gpus::resolve(args, launch, &recipe, n)?,
        None => (args.clone(), launch.clone(), recipe),
    };
    let (args, launch) = (&args, &launch);
    if let Some(nproc_per_node) = launch.nproc_per_node {
        crate::launch::check_not_nested(&|k| std::env::var(k).ok())?;
        let layout = crate::launch::NodeLayout {
            nproc_per_node,
            nnodes: launch.nnodes,
            node_rank: launch.node_rank,
            master_addr: launch.master_addr.clone(),
            master_port: launch.master_port,
        };
        let mut child: Vec<OsString> = vec!["train".into(), "--recipe".into()];
        child.push(args.recipe.clone().into());
        for o in &args.overrides {
            child.extend(["--set".into(), o.into()]);
        }
        let grace = Duration::from_secs_f64(recipe.parallel.timeout_s.min(10.0));
        let world = recipe.parallel.world_size();
        if let Some((min, max)) = launch.elastic {
            let e = crate::launch::elastic::Elastic {
                min,
                max,
                max_restarts: launch.max_restarts,
            };
            return crate::launch::elastic::spawn(&layout, &child, &recipe, grace, e);
        }
        let flight = crate::job::flight::dir(&recipe);
        return crate::launch::spawn_node(&layout, &child, world, grace, &flight);
    }
    crate::job::signals::install()?;
    let dir = recipe.run.dir.clone();
    let info = parallel::env::from_env(&|k| std::env::var(k).ok())?;
    let (out, main) = match info {
        Some(info) if info.world_size > 1 => {
            let deadline = crate::launch::deadline::for_timeout(recipe.parallel.timeout_s);
            crate::launch::deadline::install(info.rank, deadline);
            let job = crate::launch::join(&info, &recipe)?;
            // A GPU per process; on the CPU the node's processes share its memory.
            let here = if job.device.is_cuda() {
                1
            } else {
                std::env::var("LOCAL_WORLD_SIZE")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1)
            };
            if let Err(e) = crate::train::admit::admit(&recipe, here, &job.device) {
                job.comm.abort(&format!("{e:#}"));
                return Err(e.context(format!("rank {}", info.rank)));
            }
            // SIGUSR1 logs what every rank of this node is doing (the launcher, when there is
            // one, says it for the node instead).
            let flight_dir = crate::job::flight::dir(&recipe);
            let world = info.world_size;
            let launched = std::env::var_os("PRETRAIN_LAUNCHED").is_some();
            let _watch = if launched {
                crate::job::flight::install_usr1()?;
                None
            } else {
                let d = flight_dir.clone();
                Some(crate::job::flight::watch(move || {
                    crate::job::flight::from_dir(&d, world)
                })?)
            };
            let mine = crate::train::run_rank(
                &recipe,
                info.rank,
                job.comm.clone(),
                job.device.clone(),
                true,
            )
            .map_err(|e| in_rank(e, info.rank));
            let mine = match mine {
                Ok(m) => m,
                Err(e) => {
                    // Without a launcher of ours, rank 0 says what the ranks it can read (its
                    // node's, or all on a shared run.dir) were doing when a peer went missing.
                    if info.rank == 0 && !launched && crate::job::flight::timed_out(&e) {
                        let d = crate::job::flight::from_dir(&flight_dir, world);
                        crate::job::flight::report(&d);
                    }
                    // From here the process ends within the deadline, however its teardown goes.
                    parallel::comm::failure::report(info.rank, &format!("{e:#}"));
                    stuck_for_tests();
                    return Err(e);
                }
            };
            (crate::train::collect(vec![mine]), info.rank == 0)
        }
        _ => (crate::train::train_to_files(recipe)?, true),
    };
    if !main {
        return Ok(());
    }
    if let Some(last) = out.records.last() {
        let text = crate::train::loss_text;
        let val = out
            .val_loss
            .map_or(String::new(), |v| format!(", val_loss={}", text(v)));
        info!(
            "done: {} steps, final loss={}{val}",
            last.step,
            text(last.loss)
        );
    }
    info!(
        "metrics: {}, plot: {}",
        dir.join("metrics.jsonl").display(),
        dir.join("loss.svg").display()
    );
    Ok(())
}

/// `e` in the context `rank R`, unless its message already starts by naming this rank (a
/// communication error of this rank's own call reads `rank R: all_reduce over …`).
fn in_rank(e: anyhow::Error, rank: usize) -> anyhow::Error {
    if e.to_string().starts_with(&format!("rank {rank}: ")) {
        e
    } else {
        e.context(format!("rank {rank}"))
    }
}

/// An injected fault (`crate::faults`): a rank process whose run failed hangs instead of
/// returning, as a teardown stuck on a dead peer would (the exit deadline must end it).
fn stuck_for_tests() {
    if crate::faults::faults().stuck_after_failure {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}
