//! Elastic restart (`--elastic MIN[:MAX] --max-restarts K`), on one node or across nodes. When
//! a rank dies or hangs past `parallel.timeout_s`, the survivors stop (as in any job); when a
//! node dies whole, its launcher's heartbeat stops. Every launcher then meets the others for a
//! new round at node 0's launcher (`rendezvous.rs`), which decides it (`coordinator.rs`): each
//! rank that failed on its own is taken out of its node's slots (its GPU may be what failed),
//! a lost node is left behind, the planner picks the fastest valid layout of the same model,
//! global batch and data order for the ranks now present (the recipe's own layout when it
//! still has that many ranks; otherwise fewer ranks where no layout uses them all, down to
//! MIN), and training resumes from the newest complete checkpoint (`checkpoint.resume=auto`;
//! the data sampler is layout-free, and `metrics.jsonl` drops the records of the steps redone).
//! A launcher that comes back registers for the next round: node 0's stops the running round
//! at the end of a step (its ranks save) and the job grows to take it, up to MAX ranks. A
//! launcher stopped by SIGTERM/SIGINT leaves: the job saves and goes on without its node.
//! Only failures count against K. The log says which ranks or nodes were lost, the new layout,
//! the checkpoint's step and how many steps are redone. Fewer than MIN ranks, K restarts used,
//! or no layout fitting: an error naming which, on every launcher.
//!
//! On CUDA each slot is a GPU: after the first round each rank sees only its slot's GPU
//! (`CUDA_VISIBLE_DEVICES`), so a GPU that failed is not used again.
//!
//! Node 0's launcher cannot be lost: it serves the rendezvous, and rank 0 (whose store the
//! ranks meet at) runs on its host. The run directory must be shared by the nodes (checkpoints
//! and `metrics.jsonl`), as for any multi-node resume.

use std::ffi::OsString;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::coordinator::Coordinator;
use super::rendezvous::{Agents, Member, Outcome, Plan, Report, POLL, RENDEZVOUS_TIMEOUT};
use super::{JobFailed, NodeLayout};
use crate::plan::choose::{choose, Choice, Keep};
use crate::plan::Hardware;
use crate::recipe::{DeviceKind, Recipe, MAX_RANKS};

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

/// A layout of the job for the ranks a round has (see [`relayout`]).
pub type Relayout = Choice;

/// The layout `recipe` continues on with `nodes` (slots per node, node 0 first; at least `min`
/// ranks used): its own when it takes exactly all the slots and fits them node by node, else the
/// planner's fastest fitting candidate (on the GPUs found here; for a CPU recipe only the ranking
/// matters) that keeps the recipe's micro-batch, recompute, moments, ZeRO stage, sequence
/// parallelism and zero-bubble schedule, with as many ranks as can be placed with every
/// tensor- and context-parallel group inside one node (`plan::choose`, which `--gpus` shares).
pub fn relayout(recipe: &Recipe, nodes: &[usize], min: usize) -> Option<Relayout> {
    let per_node = nodes.iter().copied().max().unwrap_or(1);
    let hw = Hardware::found(recipe, per_node);
    choose(recipe, nodes, min, &hw, Keep::Levers)
}

/// `super::spawn_node` with elastic restarts (see the module docs): `recipe` is the job's, `args`
/// its command line; each round after the first adds its layout and `checkpoint.resume=auto`.
pub fn spawn(
    layout: &NodeLayout,
    args: &[OsString],
    recipe: &Recipe,
    grace: Duration,
    e: Elastic,
) -> Result<()> {
    check(&e, layout)?;
    let (n, node) = (layout.nproc_per_node, layout.node_rank);
    let addr = super::master_addr(layout)?;
    let flight = crate::job::flight::dir(recipe);
    let (mut agents, mut coordinator) = meet(layout, &addr, recipe, e)?;
    // The node's slots still in use (a GPU each on CUDA): a rank that failed on its own loses
    // its slot, and a later round's local rank `i` runs on slot `free[i]`.
    let mut free: Vec<usize> = (0..n).collect();
    let gpus = recipe.train.device == DeviceKind::Cuda;
    let outer = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let mut r = agents.first_round()?;
    let mut ended = Instant::now();
    loop {
        agents.register(r, free.len())?;
        let plan = match coordinator.as_mut() {
            Some(c) => c.decide(&mut agents, r, ended)?,
            None => agents.plan(r)?,
        };
        if let Some(err) = &plan.error {
            bail!("{err}");
        }
        let report = match plan.member(node).filter(|m| m.nproc > 0).cloned() {
            None => idle(&mut agents, &plan)?,
            Some(me) => {
                let round = super::Round {
                    node,
                    // Nodes may offer different slots: the plan, not --nnodes, places the ranks.
                    nnodes: None,
                    first_rank: me.first_rank,
                    nproc: me.nproc,
                    world: plan.world,
                    addr: addr.clone(),
                    port: plan.port,
                    token: Some(plan.token.clone()),
                    // After the first round each CUDA rank sees only its slot's GPU.
                    devices: (gpus && r > 0)
                        .then(|| visible_devices(&free[..me.nproc], outer.as_deref())),
                };
                let mut round_args = args.to_vec();
                for o in plan
                    .overrides
                    .iter()
                    .cloned()
                    .chain((r > 0).then(|| "checkpoint.resume=auto".to_string()))
                {
                    round_args.extend(["--set".into(), o.into()]);
                }
                // The store is asked at most every POLL; a lost store is reported once (the
                // ranks still stop as their own failure handling makes them).
                let (mut last, mut warned) = (None::<Instant>, false);
                let mut poll = || -> bool {
                    if last.is_some_and(|t| t.elapsed() < POLL) {
                        return false;
                    }
                    last = Some(Instant::now());
                    let asked = match coordinator.as_mut() {
                        Some(c) => c.should_grow(&mut agents, &plan),
                        None => Ok(false),
                    };
                    match asked.and_then(|g| Ok(g || agents.stop_asked(plan.round)?)) {
                        Ok(stop) => stop,
                        Err(err) => {
                            if !std::mem::replace(&mut warned, true) {
                                tracing::warn!("elastic: the launchers' store: {err:#}");
                            }
                            false
                        }
                    }
                };
                let outcome = super::start_ranks(&round, &round_args, grace, &flight, &mut poll);
                ended = Instant::now();
                let report = judge(outcome, &me, &mut free)?;
                if report.outcome == Outcome::Left {
                    agents.report(r, &report)?;
                    return Err(crate::job::signals::Interrupted {
                        signal: crate::job::signals::pending().unwrap_or(libc::SIGTERM),
                        step: None,
                        checkpoint: None,
                        note: None,
                    }
                    .into());
                }
                report
            }
        };
        if report.outcome == Outcome::Finished {
            // Node 0's launcher may be gone already, its store with it: the job is done.
            let _ = agents.report(r, &report);
            return Ok(());
        }
        agents.report(r, &report)?;
        r += 1;
    }
}

/// Connects this node's launcher to the rendezvous, serving it on node 0 (`--master-port`, a
/// free loopback port on one node); node 0's launcher also coordinates.
fn meet<'a>(
    layout: &NodeLayout,
    addr: &str,
    recipe: &'a Recipe,
    e: Elastic,
) -> Result<(Agents, Option<Coordinator<'a>>)> {
    let port = super::agreed_port(layout)?.unwrap_or(0); // 0: the store binds any free port

    // Several nodes agree on a token without talking: PRETRAIN_JOB_TOKEN (or its file), else
    // one derived from public values, with a warning; one node draws a secret.
    let token = if layout.nnodes == 1 {
        super::random_token()
    } else {
        let info = parallel::env::ProcessInfo {
            rank: layout.node_rank,
            world_size: layout.nnodes,
            local_rank: 0,
            master_addr: addr.to_string(),
            master_port: port,
            launcher: "pretrain --elastic",
        };
        match super::job_token(&|k| std::env::var(k).ok(), &info)? {
            super::JobToken::Secret(t) => t,
            super::JobToken::Derived(t) => {
                if layout.node_rank == 0 {
                    tracing::warn!(
                        "no {} or {}: the launchers' token is derived from public values, so \
                         any user who can reach {addr}:{port} can join this job; set a secret \
                         token",
                        super::TOKEN_VAR,
                        super::TOKEN_FILE_VAR
                    );
                }
                t
            }
        }
    };
    if layout.node_rank != 0 {
        let agents = Agents::connect(layout.node_rank, None, &format!("{addr}:{port}"), &token)?;
        return Ok((agents, None));
    }
    let bind = super::store_bind(addr, port, layout.nnodes > 1);
    let server = parallel::store::StoreServer::start(&bind, &token, RENDEZVOUS_TIMEOUT)
        .with_context(|| {
            format!("--master-port {port}: serving the launchers' rendezvous on {bind}")
        })?;
    let at = format!("{addr}:{}", server.addr().port());
    let agents = Agents::connect(0, Some(server), &at, &token)?;
    let coordinator = Coordinator::new(
        recipe,
        e,
        (layout.nnodes, layout.nproc_per_node),
        super::store_bind(addr, 0, layout.nnodes > 1),
    );
    Ok((agents, Some(coordinator)))
}

/// How this node's round ended, from its ranks' outcome: a rank that failed on its own is
/// reported lost and its slot dropped from `free`.
fn judge(outcome: Result<()>, me: &Member, free: &mut Vec<usize>) -> Result<Report> {
    let err = match outcome {
        Ok(()) => {
            return Ok(Report {
                outcome: Outcome::Finished,
                lost: vec![],
                message: String::new(),
            })
        }
        Err(err) => err,
    };
    if let Some(f) = err.downcast_ref::<JobFailed>() {
        let mine = me.first_rank..me.first_rank + me.nproc;
        let lost = (f.own && mine.contains(&f.rank)).then_some(f.rank);
        if let Some(rank) = lost {
            free.remove(rank - me.first_rank);
        }
        return Ok(Report {
            outcome: Outcome::Failed,
            lost: lost.into_iter().collect(),
            message: f.message.clone(),
        });
    }
    if err
        .downcast_ref::<crate::job::signals::Interrupted>()
        .is_some()
    {
        // Stopped by a signal to this launcher: it leaves; else asked by the rendezvous, or
        // following a node that left.
        let outcome = if crate::job::signals::pending().is_some() {
            Outcome::Left
        } else {
            Outcome::Stopped
        };
        return Ok(Report {
            outcome,
            lost: vec![],
            message: err.to_string(),
        });
    }
    Err(err) // the launcher's own failure
}

/// A node with no ranks in round `plan`: waits for node 0's report of the round; finished if
/// the job did.
fn idle(agents: &mut Agents, plan: &Plan) -> Result<Report> {
    tracing::info!(
        "elastic round {}: the layout for {} ranks leaves node {} idle; waiting for the next \
         round",
        plan.round,
        plan.world,
        agents.node
    );
    loop {
        agents.beat()?;
        if let Some(rep) = agents.report_of(plan.round, 0)? {
            let outcome = match rep.outcome {
                Outcome::Finished => Outcome::Finished,
                _ => Outcome::Stopped,
            };
            return Ok(Report {
                outcome,
                lost: vec![],
                message: String::new(),
            });
        }
        std::thread::sleep(Duration::from_millis(200));
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

/// Refuses what elastic restarts cannot do, and more rank processes than a node runs: at most
/// 4 per core of this machine, and [`MAX_RANKS`] in the job.
pub fn check(e: &Elastic, layout: &NodeLayout) -> Result<()> {
    super::check_layout(layout)?;
    let n = layout.nproc_per_node;
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    if n > 4 * cores {
        bail!(
            "--nproc-per-node {n} is more rank processes than this node runs: at most 4 × its \
             {cores} cores"
        );
    }
    let Some(slots) = n.checked_mul(layout.nnodes).filter(|&s| s <= MAX_RANKS) else {
        bail!(
            "--nproc-per-node {n} × --nnodes {} exceeds {MAX_RANKS}, the most ranks a job may \
             have",
            layout.nnodes
        );
    };
    if e.min > slots {
        bail!(
            "--elastic minimum {} exceeds the job's {slots} ranks (--nproc-per-node {} × \
             --nnodes {})",
            e.min,
            layout.nproc_per_node,
            layout.nnodes
        );
    }
    if let Some(max) = e.max.filter(|&m| m < slots) {
        bail!("--elastic maximum {max} is below the job's {slots} ranks at the start");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

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
        let four = relayout(&r, &[4], 2).unwrap();
        assert_eq!((four.world, four.layout.dp, four.layout.tp), (4, 2, 2));
        // On 3 ranks a valid layout uses all 3 (pipeline stages, balanced), on 2 both.
        let three = relayout(&r, &[3], 2).unwrap();
        assert_eq!(three.world, 3, "{three:?}");
        assert_eq!(relayout(&r, &[2], 2).unwrap().world, 2);
        let l = &three.layout;
        assert_eq!(l.dp * l.tp * l.cp * l.pp, three.world);
        let applied = crate::recipe::load(
            Path::new("recipes/tiny.yaml"),
            &[o[0].clone(), three.overrides()],
        )
        .unwrap();
        assert_eq!(applied.parallel.world_size(), three.world);
        // Nothing below the minimum.
        assert!(relayout(&r, &[1], 2).is_none());
        // A zero-bubble job stays zero-bubble, with the schedule its new chunks allow.
        let zbv = "parallel.dp=2,parallel.pp=2,parallel.virtual_stages=2,parallel.schedule=zbv,\
                   train.global_batch=16,train.micro_batch=4";
        let r = crate::recipe::load(Path::new("recipes/tiny.yaml"), &[zbv.to_string()]).unwrap();
        let three = relayout(&r, &[3], 2).unwrap();
        let l = &three.layout;
        use parallel::pipeline::ScheduleKind as K;
        let zero_bubble = matches!(l.schedule, K::ZeroBubbleH1 | K::ZeroBubbleV);
        assert!(l.pp == 1 || zero_bubble, "{three:?}");
        let set = [zbv.to_string(), three.overrides()];
        let applied = crate::recipe::load(Path::new("recipes/tiny.yaml"), &set).unwrap();
        assert_eq!(applied.parallel.schedule_kind(), l.schedule);
    }

    /// After a GPU is lost, the layout and the placement keep every tensor- and
    /// context-parallel group on one node (greedy placement split them: ranks shifted by one on
    /// every node after the degraded one).
    #[test]
    fn a_lost_gpu_never_splits_a_tensor_parallel_group_across_nodes() {
        use crate::launch::rendezvous::assign;
        use parallel::mesh::{Axis, Mesh};
        let o = vec![
            // Context parallelism is kept by every layout: units of at least 2 ranks.
            "parallel.dp=4,parallel.cp=2,train.global_batch=32,train.micro_batch=2".to_string(),
        ];
        let r = crate::recipe::load(Path::new("recipes/tiny.yaml"), &o).unwrap();
        for nodes in [vec![4, 3, 4], vec![3, 4, 4], vec![4, 4, 3], vec![2, 1, 4]] {
            let next = relayout(&r, &nodes, 2).unwrap();
            let applied = crate::recipe::load(
                Path::new("recipes/tiny.yaml"),
                &[o[0].clone(), next.overrides()],
            )
            .unwrap();
            let mesh = Mesh::from_config(&applied.parallel).unwrap();
            let slots: Vec<(usize, usize)> = nodes.iter().copied().enumerate().collect();
            let members = assign(&slots, next.world, next.layout.tp * next.layout.cp);
            let node_of = |rank: usize| {
                let on = |m: &&Member| (m.first_rank..m.first_rank + m.nproc).contains(&rank);
                members.iter().find(on).map(|m| m.node)
            };
            assert_eq!(
                members.iter().map(|m| m.nproc).sum::<usize>(),
                next.world,
                "{nodes:?}: every rank placed"
            );
            for rank in 0..next.world {
                for axis in [Axis::Tp, Axis::Cp] {
                    let g = mesh.group(axis, rank);
                    let homes: Vec<_> = g.ranks().iter().map(|&q| node_of(q)).collect();
                    assert!(
                        homes.iter().all(|h| *h == homes[0]),
                        "{nodes:?} {}: {axis:?} group {:?} on nodes {homes:?}",
                        next.describe(),
                        g.ranks()
                    );
                }
            }
        }
    }
}
