//! Elastic restart of a node's job (`--elastic MIN[:MAX] --max-restarts K`). When a rank dies or
//! hangs past `parallel.timeout_s`, the survivors stop (as in any job), and the launcher starts
//! the job again on the ranks left: each rank that failed on its own is taken out of the node's
//! slots (its GPU may be what failed), the planner picks the fastest valid layout of the same
//! model, global batch and data order for the ranks now present (the recipe's own layout when it
//! still has that many ranks; otherwise fewer ranks where no layout uses them all, down to MIN),
//! and training resumes from the newest complete checkpoint (`checkpoint.resume=auto`; the data
//! sampler is layout-free, and `metrics.jsonl` drops the records of the steps redone). The log
//! says which rank was lost, the new layout, the checkpoint's step and how many steps are
//! redone. Fewer than MIN slots, K restarts used, or no layout fitting: an error naming which.
//!
//! On CUDA each slot is a GPU: after a restart each rank sees only its slot's GPU
//! (`CUDA_VISIBLE_DEVICES`), so a GPU that failed is not used again.
//!
//! One node: the store lives in rank 0's process, so a job spanning nodes cannot outlive its
//! rank 0; `--elastic` with `--nnodes` above 1 is refused.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::ffi::OsString;

use anyhow::{bail, Result};
use parallel::pipeline::ScheduleKind;

use super::{JobFailed, NodeLayout};
use crate::plan::{search::candidates, GpuPreset, Layout};
use crate::recipe::{DeviceKind, Recipe};

/// `--elastic MIN[:MAX]`: the fewest ranks a job may continue on, the most it starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elastic {
    /// Fewest ranks.
    pub min: usize,
    /// Most ranks (the node's `--nproc-per-node` without it).
    pub max: Option<usize>,
    /// Restarts allowed (`--max-restarts`).
    pub max_restarts: usize,
}

/// Parses `MIN[:MAX]`.
pub fn parse_range(s: &str) -> Result<(usize, Option<usize>), String> {
    let bad = || format!("--elastic {s:?}: expected MIN or MIN:MAX, e.g. 2:4");
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (a, Some(b)),
        None => (s, None),
    };
    let min: usize = min.trim().parse().map_err(|_| bad())?;
    let max = max
        .map(|m| m.trim().parse::<usize>().map_err(|_| bad()))
        .transpose()?;
    if min == 0 || max.is_some_and(|m| m < min) {
        return Err(format!(
            "--elastic {s:?}: MIN must be at least 1 and MAX at least MIN"
        ));
    }
    Ok((min, max))
}

/// A layout of the job for a number of ranks, as `--set` overrides.
#[derive(Debug, Clone, PartialEq)]
pub struct Relayout {
    /// Ranks it uses.
    pub world: usize,
    /// The layout.
    pub layout: Layout,
    /// `parallel.pipeline_layout` when its stages are uneven.
    pub pipeline_layout: Option<Vec<usize>>,
}

impl Relayout {
    /// The overrides that give `recipe` this layout.
    pub fn overrides(&self) -> String {
        let l = &self.layout;
        let mut s = format!(
            "parallel.dp={},parallel.tp={},parallel.cp={},parallel.pp={},parallel.ep={},\
             parallel.virtual_stages={},parallel.sequence_parallel={},parallel.zero={},\
             parallel.schedule={},train.micro_batch={},train.recompute={},\
             optimizer.state_dtype={}",
            l.dp,
            l.tp,
            l.cp,
            l.pp,
            l.ep,
            l.virtual_stages,
            l.sequence_parallel,
            l.zero,
            l.schedule.recipe_name(),
            l.micro_batch,
            l.recompute,
            l.state_dtype
        );
        match &self.pipeline_layout {
            Some(p) => s.push_str(&format!(",parallel.pipeline_layout={p:?}")),
            None => s.push_str(",parallel.pipeline_layout=null"),
        }
        s
    }

    /// `dp=2 tp=2 pp=1 …` for the log.
    pub fn describe(&self) -> String {
        let l = &self.layout;
        let mut s = format!(
            "{} ranks: dp={} tp={} cp={} pp={} ep={}",
            self.world, l.dp, l.tp, l.cp, l.pp, l.ep
        );
        if let Some(p) = &self.pipeline_layout {
            s.push_str(&format!(" pipeline_layout={p:?}"));
        }
        s
    }
}

/// The layout `recipe` continues on with `slots` ranks available (at least `min` used): its own
/// when it has exactly `slots` ranks, else the planner's fastest fitting candidate (on the H100
/// preset; for a CPU recipe only the ranking matters) that keeps the recipe's micro-batch,
/// recompute and moments, with all `slots` ranks or, where none is valid, fewer.
pub fn relayout(recipe: &Recipe, slots: usize, min: usize) -> Option<Relayout> {
    let own = Layout::of(recipe);
    if recipe.parallel.world_size() == slots {
        return Some(Relayout {
            world: slots,
            layout: own,
            pipeline_layout: recipe.parallel.pipeline_layout.clone(),
        });
    }
    let hw = GpuPreset::H100.hardware();
    (min..=slots).rev().find_map(|n| {
        candidates(recipe, &hw, n)
            .into_iter()
            .map(|c| c.plan)
            .filter(|p| p.fits)
            .find(|p| {
                let l = &p.layout;
                l.micro_batch == own.micro_batch
                    && l.recompute == own.recompute
                    && l.state_dtype == own.state_dtype
                    && (l.zero == own.zero || !own.zero.shards_optimizer())
                    && l.sequence_parallel == (own.sequence_parallel && l.tp > 1)
                    // A zero-bubble schedule stays one (zb-h1 or zbv, as the chunks allow).
                    && (l.pp == 1 || zero_bubble(l.schedule) == zero_bubble(own.schedule))
            })
            .map(|p| Relayout {
                world: n,
                layout: p.layout,
                pipeline_layout: p.pipeline_layout.clone(),
            })
    })
}

/// Whether `kind` splits backwards.
fn zero_bubble(kind: ScheduleKind) -> bool {
    matches!(kind, ScheduleKind::ZeroBubbleH1 | ScheduleKind::ZeroBubbleV)
}

/// The newest complete checkpoint's step under `root`, if any.
pub fn checkpoint_step(root: &Path) -> Option<u64> {
    let dir = ckpt::find_latest(root).ok()??;
    ckpt::Checkpoint::open(&dir).ok().map(|c| c.manifest().step)
}

/// The last step `run_dir/metrics.jsonl` records.
pub fn last_step(run_dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).ok()?;
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .filter_map(|v| v.get("step")?.as_u64())
        .max()
}

/// `super::spawn_node` with elastic restarts (see the module docs): `recipe` is the job's, `args` its
/// command line; each restart adds the new layout and `checkpoint.resume=auto`.
pub fn spawn(
    layout: &NodeLayout,
    args: &[OsString],
    recipe: &Recipe,
    grace: Duration,
    e: Elastic,
) -> Result<()> {
    check(&e, layout.nproc_per_node, layout.nnodes)?;
    let flight = crate::train::flight::dir(recipe);
    // The node's slots still in use (a GPU each on CUDA): the lost rank's slot is dropped, and
    // a later round's local rank `i` runs on slot `free[i]`.
    let mut free: Vec<usize> = (0..layout.nproc_per_node).collect();
    let gpus = recipe.train.device == DeviceKind::Cuda;
    let mut round_args = args.to_vec();
    let mut world = recipe.parallel.world_size();
    let mut restart = 0;
    let mut watcher: Option<Resumed> = None;
    loop {
        let round = NodeLayout {
            nproc_per_node: world,
            ..layout.clone()
        };
        // After a restart each CUDA rank sees only its slot's GPU.
        let outer = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let devices = (gpus && restart > 0).then(|| visible_devices(&free, outer.as_deref()));
        let outcome = super::spawn_round(&round, &round_args, world, grace, &flight, devices);
        drop(watcher.take()); // the round's resume watcher
        let err = match outcome {
            Ok(()) => return Ok(()),
            Err(err) => err,
        };
        let failed_at = std::time::Instant::now();
        let Some(failed) = err.downcast_ref::<JobFailed>() else {
            return Err(err); // a stop signal, or the launcher's own failure
        };
        if restart == e.max_restarts {
            return Err(err.context(format!(
                "--max-restarts {} used up; not restarting again",
                e.max_restarts
            )));
        }
        let lost = failed.rank;
        if lost < free.len() {
            free.remove(lost); // one node: the rank is the round's local rank
        }
        let slots = free.len();
        if slots < e.min {
            return Err(err.context(format!(
                "rank {lost} lost: {slots} ranks left, below the --elastic minimum {}",
                e.min
            )));
        }
        let Some(next) = relayout(recipe, slots, e.min) else {
            return Err(err.context(format!(
                "rank {lost} lost: no valid layout of the recipe fits {slots} down to {} ranks",
                e.min
            )));
        };
        let resumed = checkpoint_step(&recipe.checkpoint_root());
        let reached = last_step(&recipe.run.dir).unwrap_or(0);
        let from = resumed.unwrap_or(0);
        tracing::warn!(
            "elastic restart {}/{}: rank {lost} lost ({slots} ranks left: {}); restarting on \
             {}; resuming from {} ({} steps redone)",
            restart + 1,
            e.max_restarts,
            failed.message,
            next.describe(),
            match resumed {
                Some(s) => format!("the checkpoint of step {s}"),
                None => "the start (no checkpoint yet)".to_string(),
            },
            reached.saturating_sub(from)
        );
        world = next.world;
        watcher = Some(Resumed::watch(&recipe.run.dir, from, failed_at));
        round_args = args.to_vec();
        round_args.extend([
            "--set".into(),
            next.overrides().into(),
            "--set".into(),
            "checkpoint.resume=auto".into(),
        ]);
        restart += 1;
    }
}

/// Reports when a restarted round has trained its first step: a thread watching
/// `metrics.jsonl`, which logs the time since the failure was detected (stopped when dropped).
pub struct Resumed {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Resumed {
    /// Watches `run_dir` for a step after `from` written after `failed_at`.
    pub fn watch(run_dir: &Path, from: u64, failed_at: Instant) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (quit, dir) = (stop.clone(), run_dir.to_path_buf());
        let thread = std::thread::spawn(move || {
            let path = dir.join("metrics.jsonl");
            while !quit.load(Ordering::Relaxed) {
                let fresh = std::fs::metadata(&path)
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t.elapsed().is_ok_and(|e| e < failed_at.elapsed()));
                if fresh && last_step(&dir).is_some_and(|s| s > from) {
                    tracing::info!(
                        "elastic restart: training resumed {:.1} s after the failure was \
                         detected (step {} done)",
                        failed_at.elapsed().as_secs_f64(),
                        from + 1
                    );
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Resumed {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `CUDA_VISIBLE_DEVICES` for the local ranks of a round on slots `free`: the GPU each slot
/// stands for, through the launcher's own `CUDA_VISIBLE_DEVICES` (`outer`) when it has one.
pub fn visible_devices(free: &[usize], outer: Option<&str>) -> Vec<String> {
    let listed: Option<Vec<String>> = outer
        .filter(|v| !v.trim().is_empty())
        .map(|v| v.split(',').map(|d| d.trim().to_string()).collect());
    free.iter()
        .map(|&slot| match &listed {
            Some(l) => l.get(slot).cloned().unwrap_or_else(|| slot.to_string()),
            None => slot.to_string(),
        })
        .collect()
}

/// Refuses what elastic restarts cannot do.
pub fn check(e: &Elastic, nproc_per_node: usize, nnodes: usize) -> Result<()> {
    if nnodes > 1 {
        bail!(
            "--elastic with --nnodes {nnodes}: restarts across nodes need a rendezvous store \
             outside rank 0, which this launcher does not run; use --elastic on one node"
        );
    }
    if e.min > nproc_per_node {
        bail!(
            "--elastic minimum {} exceeds --nproc-per-node {nproc_per_node}",
            e.min
        );
    }
    if let Some(max) = e.max.filter(|&m| m < nproc_per_node) {
        bail!("--elastic maximum {max} is below --nproc-per-node {nproc_per_node}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_are_checked() {
        assert_eq!(parse_range("2:4"), Ok((2, Some(4))));
        assert_eq!(parse_range("3"), Ok((3, None)));
        assert!(parse_range("0:4")
            .unwrap_err()
            .contains("MIN must be at least 1"));
        assert!(parse_range("4:2").unwrap_err().contains("MAX at least MIN"));
        assert!(parse_range("a")
            .unwrap_err()
            .contains("expected MIN or MIN:MAX"));
    }

    #[test]
    fn each_slot_keeps_its_gpu() {
        assert_eq!(visible_devices(&[0, 2, 3], None), ["0", "2", "3"]);
        assert_eq!(visible_devices(&[0, 2], Some("4,5,6,7")), ["4", "6"]);
        assert_eq!(visible_devices(&[1], Some(" ")), ["1"]);
    }

    #[test]
    fn the_layout_follows_the_ranks_left() {
        let o = vec![
            "parallel.dp=2,parallel.tp=2,train.global_batch=16,train.micro_batch=4".to_string(),
        ];
        let r = crate::recipe::load(Path::new("recipes/tiny.yaml"), &o).unwrap();
        // Its own on 4.
        let four = relayout(&r, 4, 2).unwrap();
        assert_eq!((four.world, four.layout.dp, four.layout.tp), (4, 2, 2));
        // On 3 ranks some valid layout uses all 3 (pipeline stages, balanced) or, else, fewer.
        let three = relayout(&r, 3, 2).unwrap();
        assert!(three.world <= 3 && three.world >= 2, "{three:?}");
        let l = &three.layout;
        assert_eq!(l.dp * l.tp * l.cp * l.pp, three.world);
        let applied = crate::recipe::load(
            Path::new("recipes/tiny.yaml"),
            &[o[0].clone(), three.overrides()],
        )
        .unwrap();
        assert_eq!(applied.parallel.world_size(), three.world);
        // Nothing below the minimum.
        assert!(relayout(&r, 1, 2).is_none());
        // A zero-bubble job stays zero-bubble, with the schedule its new chunks allow.
        let zbv = "parallel.dp=2,parallel.pp=2,parallel.virtual_stages=2,parallel.schedule=zbv,\
                   train.global_batch=16,train.micro_batch=4";
        let r = crate::recipe::load(Path::new("recipes/tiny.yaml"), &[zbv.to_string()]).unwrap();
        let three = relayout(&r, 3, 2).unwrap();
        let l = &three.layout;
        assert!(l.pp == 1 || zero_bubble(l.schedule), "{three:?}");
        let set = [zbv.to_string(), three.overrides()];
        let applied = crate::recipe::load(Path::new("recipes/tiny.yaml"), &set).unwrap();
        assert_eq!(applied.parallel.schedule_kind(), l.schedule);
    }
}
