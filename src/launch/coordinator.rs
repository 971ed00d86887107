//! Node 0's launcher deciding an elastic job's rounds (see `rendezvous.rs`): who is present,
//! what the last round's end means (a failure counts against `--max-restarts`; a node that
//! left on a signal or a node that joined does not), the layout for the ranks now present, and
//! when to stop a running round so that a returning node can join it.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::elastic::{relayout, Elastic};
use super::rendezvous::{
    assign, Agents, Liveness, Outcome, Plan, Report, LAST_CALL, RENDEZVOUS_TIMEOUT,
};
use crate::recipe::Recipe;

/// Between two looks for launchers waiting to join a running round.
const GROWTH_POLL: Duration = Duration::from_secs(1);

/// What node 0's launcher keeps between rounds.
pub struct Coordinator<'a> {
    recipe: &'a Recipe,
    e: Elastic,
    /// Most ranks (`--elastic MIN:MAX`, else every node's slots).
    max_ranks: usize,
    nnodes: usize,
    /// Where rank 0's store is served (node 0's host).
    store_bind: String,
    prev: Option<Plan>,
    live: Liveness,
    last_growth_look: Option<Instant>,
    /// Reports when the round after a change trains its first step.
    watcher: Option<Resumed>,
}

impl<'a> Coordinator<'a> {
    /// A coordinator for `nnodes` launchers of `nproc_per_node` slots; rank 0's stores bind
    /// `store_bind` (an address with port 0).
    pub fn new(
        recipe: &'a Recipe,
        e: Elastic,
        (nnodes, nproc_per_node): (usize, usize),
        store_bind: String,
    ) -> Self {
        Self {
            recipe,
            e,
            max_ranks: e.max.unwrap_or(nnodes * nproc_per_node),
            nnodes,
            store_bind,
            prev: None,
            live: Liveness::default(),
            last_growth_look: None,
            watcher: None,
        }
    }

    /// Decides and publishes round `r` (node 0 has registered for it; its report of round
    /// `r − 1`, ended at `ended`, is filed). An error plan is published too, then returned.
    pub fn decide(&mut self, agents: &mut Agents, r: u64, ended: Instant) -> Result<Plan> {
        self.watcher = None;
        let prev = self.prev.take();
        let mut change = Change::default();
        if let Some(p) = &prev {
            self.read_reports(agents, p, &mut change)?;
        }
        let nodes = self.wait_for_nodes(agents, r, prev.as_ref(), &change)?;
        for &(node, _) in &nodes {
            if prev.as_ref().is_some_and(|p| p.member(node).is_none()) {
                change.joined.push(node);
            }
        }
        let failures = prev.as_ref().map_or(0, |p| p.failures) + usize::from(change.failed);
        let mut plan = Plan {
            round: r,
            world: 0,
            port: 0,
            token: super::random_token(),
            overrides: None,
            members: Vec::new(),
            failures,
            error: None,
        };
        let total: usize = nodes.iter().map(|n| n.1).sum();
        let what = change.describe();
        if let Some(p) = prev.as_ref().filter(|_| change.failed) {
            if p.failures == self.e.max_restarts {
                plan.error = Some(format!(
                    "{what}: --max-restarts {} used up; not restarting again",
                    self.e.max_restarts
                ));
            }
        }
        if plan.error.is_none() && !nodes.iter().any(|n| n.0 == 0) {
            plan.error = Some(format!(
                "{what}: node 0, whose launcher serves the rendezvous, has no slots left"
            ));
        }
        if plan.error.is_none() && total < self.e.min {
            plan.error = Some(format!(
                "{what}: {total} ranks left, below the --elastic minimum {}",
                self.e.min
            ));
        }
        // The planner's search only when the job can go on.
        let next = plan
            .error
            .is_none()
            .then(|| {
                let slots: Vec<usize> = nodes.iter().map(|n| n.1).collect();
                relayout(self.recipe, &slots, self.e.min)
            })
            .flatten();
        if plan.error.is_none() && next.is_none() {
            plan.error = Some(format!(
                "{what}: no valid layout of the recipe fits {total} down to {} ranks with its \
                 tensor- and context-parallel groups inside nodes of {:?} slots",
                self.e.min,
                nodes.iter().map(|n| n.1).collect::<Vec<_>>()
            ));
        }
        if let (None, Some(next)) = (&plan.error, next) {
            plan.world = next.world;
            plan.members = assign(&nodes, next.world, next.layout.tp * next.layout.cp);
            plan.port = std::net::TcpListener::bind(&self.store_bind)
                .and_then(|l| l.local_addr())
                .map(|a| a.port())?;
            let own = next.world == self.recipe.parallel.world_size();
            plan.overrides = (!own || r > 0).then(|| next.overrides());
            if prev.is_some() {
                let resumed = checkpoint_step(&self.recipe.checkpoint_root());
                let reached = last_step(&self.recipe.run.dir).unwrap_or(0);
                let from = resumed.unwrap_or(0);
                let head = if change.failed {
                    format!(
                        "elastic restart {}/{}: {what} ({total} ranks left{})",
                        failures,
                        self.e.max_restarts,
                        change.messages()
                    )
                } else {
                    format!("elastic round {r}: {what}")
                };
                tracing::warn!(
                    "{head}; restarting on {}; resuming from {} ({} steps redone)",
                    next.describe(),
                    match resumed {
                        Some(s) => format!("the checkpoint of step {s}"),
                        None => "the start (no checkpoint yet)".to_string(),
                    },
                    reached.saturating_sub(from)
                );
                self.watcher = Some(Resumed::watch(&self.recipe.run.dir, from, ended));
            } else if !own {
                tracing::warn!(
                    "elastic: the recipe's layout takes {} ranks, {total} started; running on {} \
                     instead",
                    self.recipe.parallel.world_size(),
                    next.describe()
                );
            }
        }
        agents.publish(&plan)?;
        if let Some(e) = &plan.error {
            anyhow::bail!("{e}");
        }
        self.prev = Some(plan.clone());
        Ok(plan)
    }

    /// Reads every member's report of the round `p`, waiting for those still alive.
    fn read_reports(&mut self, agents: &mut Agents, p: &Plan, change: &mut Change) -> Result<()> {
        let deadline = Instant::now() + RENDEZVOUS_TIMEOUT;
        let mut pending: Vec<usize> = p.members.iter().map(|m| m.node).collect();
        while !pending.is_empty() {
            agents.beat()?;
            let mut still = Vec::new();
            for node in pending {
                match agents.report_of(p.round, node)? {
                    Some(rep) => change.note(node, &rep),
                    None if self.live.alive(agents, node)? && Instant::now() < deadline => {
                        still.push(node)
                    }
                    None => {
                        let m = p.member(node).expect("a member");
                        change.failed = true;
                        change
                            .dead
                            .push((node, m.first_rank..m.first_rank + m.nproc));
                    }
                }
            }
            pending = still;
            if !pending.is_empty() {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        Ok(())
    }

    /// The nodes (node, slots with a rank each, capped at MAX ranks) to place round `r` on:
    /// at the first round every node, or those present after [`LAST_CALL`] once they hold
    /// MIN ranks; later every node of the last round that is still alive and did not leave,
    /// and any that joined.
    fn wait_for_nodes(
        &mut self,
        agents: &mut Agents,
        r: u64,
        prev: Option<&Plan>,
        change: &Change,
    ) -> Result<Vec<(usize, usize)>> {
        let start = Instant::now();
        let expected: Vec<usize> = match prev {
            None => (0..self.nnodes).collect(),
            Some(p) => p
                .members
                .iter()
                .map(|m| m.node)
                .filter(|n| !change.gone(*n))
                .collect(),
        };
        loop {
            agents.beat()?;
            let present = agents.registered(r)?;
            let mut missing = Vec::new();
            for &n in &expected {
                if !present.iter().any(|p| p.0 == n) && self.live.alive(agents, n)? {
                    missing.push(n);
                }
            }
            let slots: usize = present.iter().map(|p| p.1).sum();
            let first_round_waited = prev.is_none()
                && (expected.iter().any(|n| !present.iter().any(|p| p.0 == *n)))
                && slots >= self.e.min
                && start.elapsed() >= LAST_CALL;
            let everyone = if prev.is_none() {
                expected.iter().all(|n| present.iter().any(|p| p.0 == *n))
            } else {
                missing.is_empty()
            };
            if everyone || first_round_waited || start.elapsed() >= RENDEZVOUS_TIMEOUT {
                let mut room = self.max_ranks;
                return Ok(present
                    .into_iter()
                    .filter(|p| p.1 > 0)
                    .map(|(node, slots)| {
                        let s = slots.min(room);
                        room -= s;
                        (node, s)
                    })
                    .filter(|p| p.1 > 0)
                    .collect());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// During round `plan`: whether launchers wait to join and would let the job use more
    /// ranks; if so the round is asked to stop (looked at most every [`GROWTH_POLL`]).
    pub fn should_grow(&mut self, agents: &mut Agents, plan: &Plan) -> Result<bool> {
        if self
            .last_growth_look
            .is_some_and(|t| t.elapsed() < GROWTH_POLL)
        {
            return Ok(false);
        }
        self.last_growth_look = Some(Instant::now());
        let waiting = agents.registered(plan.round + 1)?;
        if waiting.is_empty() {
            return Ok(false);
        }
        // The slots of every node, node order, the members' and the waiting ones', capped at MAX.
        let mut nodes: Vec<(usize, usize)> =
            plan.members.iter().map(|m| (m.node, m.slots)).collect();
        nodes.extend(waiting.iter().filter(|w| plan.member(w.0).is_none()));
        nodes.sort_unstable();
        let mut left = self.max_ranks;
        let slots: Vec<usize> = nodes
            .iter()
            .map(|&(_, s)| {
                let s = s.min(left);
                left -= s;
                s
            })
            .collect();
        let total: usize = slots.iter().sum();
        let grows = relayout(self.recipe, &slots, self.e.min).is_some_and(|n| n.world > plan.world);
        if grows {
            let nodes: Vec<String> = waiting.iter().map(|w| w.0.to_string()).collect();
            tracing::warn!(
                "elastic: node {} waiting to join ({total} ranks possible): stopping round {} \
                 at the end of a step to grow",
                nodes.join(", "),
                plan.round
            );
            agents.ask_stop(plan.round)?;
        }
        Ok(grows)
    }
}

/// What changed between two rounds.
#[derive(Default)]
struct Change {
    failed: bool,
    /// Ranks that failed on their own.
    lost: Vec<usize>,
    /// What the nodes reporting lost ranks said.
    why: Vec<String>,
    /// Nodes whose launcher stopped beating, with their ranks.
    dead: Vec<(usize, std::ops::Range<usize>)>,
    left: Vec<usize>,
    joined: Vec<usize>,
}

impl Change {
    fn note(&mut self, node: usize, rep: &Report) {
        match rep.outcome {
            Outcome::Failed => self.failed = true,
            Outcome::Left => self.left.push(node),
            Outcome::Finished | Outcome::Stopped => {}
        }
        if !rep.lost.is_empty() {
            self.lost.extend(&rep.lost);
            self.why.push(rep.message.clone());
        }
    }

    /// Whether `node` will not come back by itself.
    fn gone(&self, node: usize) -> bool {
        self.left.contains(&node) || self.dead.iter().any(|d| d.0 == node)
    }

    /// `rank 3 lost`, `node 1 lost (ranks 2-3)`, `node 1 left`, `node 1 joined`, ….
    fn describe(&self) -> String {
        let mut parts = Vec::new();
        match self.lost.as_slice() {
            [] => {}
            [one] => parts.push(format!("rank {one} lost")),
            many => parts.push(format!(
                "ranks {} lost",
                many.iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
        for (node, ranks) in &self.dead {
            parts.push(format!(
                "node {node} lost (its launcher stopped answering; ranks {}-{})",
                ranks.start,
                ranks.end.saturating_sub(1)
            ));
        }
        parts.extend(self.left.iter().map(|n| format!("node {n} left")));
        parts.extend(self.joined.iter().map(|n| format!("node {n} joined")));
        if parts.is_empty() && self.failed {
            parts.push("the job failed".into());
        }
        if parts.is_empty() {
            parts.push("the job stopped".into());
        }
        parts.join(", ")
    }

    /// `: <why>` when ranks were lost.
    fn messages(&self) -> String {
        if self.why.is_empty() {
            String::new()
        } else {
            format!(": {}", self.why.join("; "))
        }
    }
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

/// Reports when a restarted round has trained its first step: a thread watching
/// `metrics.jsonl`, which logs the time since the last round ended (stopped when dropped).
pub struct Resumed {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Resumed {
    /// Watches `run_dir` for a step after `from` written after `ended`.
    pub fn watch(run_dir: &Path, from: u64, ended: Instant) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (quit, dir) = (stop.clone(), run_dir.to_path_buf());
        let thread = std::thread::spawn(move || {
            let path = dir.join("metrics.jsonl");
            while !quit.load(Ordering::Relaxed) {
                let fresh = std::fs::metadata(&path)
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t.elapsed().is_ok_and(|e| e < ended.elapsed()));
                if fresh && last_step(&dir).is_some_and(|s| s > from) {
                    tracing::info!(
                        "elastic: training resumed {:.1} s after the last round ended (step {} \
                         done)",
                        ended.elapsed().as_secs_f64(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use parallel::store::StoreServer;

    /// Two launchers as two nodes, node 1 with one slot fewer (a lost GPU): node 0's launcher
    /// lays the cp 2 job out so that no context-parallel ring spans the nodes, leaving node 0's
    /// odd slot idle (greedy placement gave node 0 ranks 0-2 and split the ring {2, 3}).
    #[test]
    fn a_degraded_node_gets_whole_rings_and_leaves_its_odd_slot_idle() {
        let o = vec!["parallel.dp=2,parallel.cp=2,train.global_batch=16".to_string()];
        let recipe = crate::recipe::load(std::path::Path::new("recipes/tiny.yaml"), &o).unwrap();
        let server = StoreServer::start("127.0.0.1:0", "t", Duration::from_secs(10)).unwrap();
        let addr = server.addr().to_string();
        let mut zero = Agents::connect(0, Some(server), &addr, "t").unwrap();
        let mut one = Agents::connect(1, None, &addr, "t").unwrap();
        zero.register(0, 3).unwrap();
        one.register(0, 2).unwrap();
        let e = Elastic {
            min: 2,
            max: None,
            max_restarts: 3,
        };
        let mut c = Coordinator::new(&recipe, e, (2, 3), "127.0.0.1:0".into());
        let plan = c.decide(&mut zero, 0, Instant::now()).unwrap();
        let got: Vec<_> = plan
            .members
            .iter()
            .map(|m| (m.node, m.first_rank, m.nproc))
            .collect();
        assert_eq!((plan.world, got), (4, vec![(0, 0, 2), (1, 2, 2)]));
    }
}
