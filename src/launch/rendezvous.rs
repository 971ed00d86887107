//! The launchers' rendezvous of an elastic job (`--elastic`), on one node or many. Node 0's
//! launcher serves a store on `--master-port` (a free loopback port on one node) that outlives
//! every round of rank processes; each round the launchers present meet there, node 0's decides
//! the round's [`Plan`] (which nodes, how many ranks each, the layout, rank 0's store port and a
//! fresh job token) and every launcher starts its share of the ranks. A launcher that returns
//! (a node back from repair) registers for the next round; node 0's then stops the running
//! round (its ranks save a checkpoint at the end of a step) so the job grows to take it.
//!
//! Keys: `plan/R` (the plan of round R, JSON), `latest` (the newest planned round),
//! `r/R/count` and `r/R/node/K` (the K-th launcher registered for round R and its slots),
//! `r/R/report/N` (how node N's round R ended, JSON), `r/R/stop` (node 0 asks round R to stop),
//! `beat/N` (node N's heartbeat counter: a launcher whose counter stands still for
//! [`HEARTBEAT_TIMEOUT`] is gone, with its node).
//!
//! Node 0's launcher is the one launcher the job cannot lose: its store holds the rendezvous,
//! and rank 0's store runs on its host.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use parallel::store::{Store, StoreServer};
use serde::{Deserialize, Serialize};

/// A launcher whose heartbeat stands still this long is taken as lost with its node.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the launchers wait for each other: node 0's launcher to be up, a round's plan, a
/// node expected in a round (alive, still stopping its ranks).
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(600);

/// At the first round, once MIN ranks are present, how long to wait for the other nodes.
pub const LAST_CALL: Duration = Duration::from_secs(30);

/// Between two looks at the store.
pub const POLL: Duration = Duration::from_millis(200);

/// One node's share of a round: global ranks `first_rank..first_rank + nproc`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The node (`--node-rank`).
    pub node: usize,
    /// Slots it offered.
    pub slots: usize,
    /// Its first global rank.
    pub first_rank: usize,
    /// Ranks it runs (0: idle this round; fewer than `slots` when the layout uses fewer).
    pub nproc: usize,
}

/// A round, as node 0's launcher decided it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    /// Round number (0 first).
    pub round: u64,
    /// Ranks of the round.
    pub world: usize,
    /// Rank 0's store port (on node 0's host).
    pub port: u16,
    /// The round's job token.
    pub token: String,
    /// `--set` overrides giving the recipe the round's layout (none: the recipe's own).
    pub overrides: Option<String>,
    /// The nodes, in node order.
    pub members: Vec<Member>,
    /// Rounds so far that followed a failure (restarts used).
    pub failures: usize,
    /// Why the job cannot go on (every launcher exits with it).
    pub error: Option<String>,
}

impl Plan {
    /// `node`'s share, if it has one.
    pub fn member(&self, node: usize) -> Option<&Member> {
        self.members.iter().find(|m| m.node == node)
    }
}

/// How a node's round ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Training finished.
    Finished,
    /// Its ranks failed (on their own or following another's failure).
    Failed,
    /// Its ranks stopped as asked (a membership change), a checkpoint saved.
    Stopped,
    /// The launcher was stopped by a signal and leaves the job.
    Left,
}

/// A node's report of a round.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// How it ended.
    pub outcome: Outcome,
    /// Global ranks that failed on their own there (their slots are dropped).
    pub lost: Vec<usize>,
    /// What happened, for node 0's log.
    pub message: String,
}

/// One launcher's connection to the rendezvous (and, on node 0, its store).
pub struct Agents {
    store: Store,
    _server: Option<StoreServer>,
    /// This launcher's node.
    pub node: usize,
    beats: i64,
    last_beat: Instant,
}

impl Agents {
    /// Connects `node`'s launcher to the store at `addr` with `token`; node 0's launcher passes
    /// the `server` it serves, kept for the launcher's life.
    pub fn connect(
        node: usize,
        server: Option<StoreServer>,
        addr: &str,
        token: &str,
    ) -> Result<Self> {
        let store = Store::connect(addr, token, RENDEZVOUS_TIMEOUT)
            .with_context(|| format!("node {node}: joining the launchers' store at {addr}"))?;
        let mut a = Self {
            store,
            _server: server,
            node,
            beats: 0,
            last_beat: Instant::now(),
        };
        a.beat()?;
        Ok(a)
    }

    /// Bumps this node's heartbeat (at most every [`POLL`]).
    pub fn beat(&mut self) -> Result<()> {
        if self.beats == 0 || self.last_beat.elapsed() >= POLL {
            self.beats = self.store.add(&format!("beat/{}", self.node), 1)?;
            self.last_beat = Instant::now();
        }
        Ok(())
    }

    fn json<T: for<'de> Deserialize<'de>>(&mut self, key: &str) -> Result<Option<T>> {
        match self.store.try_get(key)? {
            Some(v) => Ok(Some(
                serde_json::from_slice(&v).with_context(|| format!("launchers' store: {key}"))?,
            )),
            None => Ok(None),
        }
    }

    fn set_json<T: Serialize>(&mut self, key: &str, v: &T) -> Result<()> {
        Ok(self.store.set(key, &serde_json::to_vec(v)?)?)
    }

    /// The round this launcher joins: 0 at the job's start, else the one after the newest
    /// planned (a launcher that returns).
    pub fn first_round(&mut self) -> Result<u64> {
        Ok(match self.store.try_get("latest")? {
            Some(v) => String::from_utf8_lossy(&v).parse::<u64>().unwrap_or(0) + 1,
            None => 0,
        })
    }

    /// Registers this node for round `r` with `slots` ranks.
    pub fn register(&mut self, r: u64, slots: usize) -> Result<()> {
        let k = self.store.add(&format!("r/{r}/count"), 1)? - 1;
        let me = (self.node, slots);
        self.set_json(&format!("r/{r}/node/{k}"), &me)
    }

    /// The nodes registered for round `r` so far, with their slots (node order).
    pub fn registered(&mut self, r: u64) -> Result<Vec<(usize, usize)>> {
        let n = self.store.add(&format!("r/{r}/count"), 0)?;
        let mut nodes = Vec::new();
        for k in 0..n {
            // Counted before it is written: absent for a moment.
            if let Some(v) = self.json::<(usize, usize)>(&format!("r/{r}/node/{k}"))? {
                nodes.push(v);
            }
        }
        nodes.sort();
        nodes.dedup_by_key(|n| n.0);
        Ok(nodes)
    }

    /// Publishes round `r`'s plan.
    pub fn publish(&mut self, plan: &Plan) -> Result<()> {
        self.set_json(&format!("plan/{}", plan.round), plan)?;
        Ok(self
            .store
            .set("latest", plan.round.to_string().as_bytes())?)
    }

    /// Round `r`'s plan, waiting for node 0 to decide it (heartbeating meanwhile).
    pub fn plan(&mut self, r: u64) -> Result<Plan> {
        let deadline = Instant::now() + RENDEZVOUS_TIMEOUT;
        loop {
            self.beat()?;
            if let Some(p) = self.json::<Plan>(&format!("plan/{r}"))? {
                return Ok(p);
            }
            if Instant::now() >= deadline {
                bail!(
                    "node {}: no plan for elastic round {r} from node 0's launcher within {} s",
                    self.node,
                    RENDEZVOUS_TIMEOUT.as_secs()
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// Files this node's report of round `r`.
    pub fn report(&mut self, r: u64, report: &Report) -> Result<()> {
        self.set_json(&format!("r/{r}/report/{}", self.node), report)
    }

    /// `node`'s report of round `r`, if filed.
    pub fn report_of(&mut self, r: u64, node: usize) -> Result<Option<Report>> {
        self.json(&format!("r/{r}/report/{node}"))
    }

    /// Asks round `r`'s ranks to stop.
    pub fn ask_stop(&mut self, r: u64) -> Result<()> {
        Ok(self.store.set(&format!("r/{r}/stop"), b"")?)
    }

    /// Whether round `r` was asked to stop (heartbeating).
    pub fn stop_asked(&mut self, r: u64) -> Result<bool> {
        self.beat()?;
        Ok(self.store.try_get(&format!("r/{r}/stop"))?.is_some())
    }

    /// `node`'s heartbeat counter.
    pub fn beats_of(&mut self, node: usize) -> Result<i64> {
        Ok(self.store.add(&format!("beat/{node}"), 0)?)
    }
}

/// Watches heartbeats: which nodes still beat.
#[derive(Default)]
pub struct Liveness {
    seen: std::collections::HashMap<usize, (i64, Instant)>,
}

impl Liveness {
    /// Whether `node`'s launcher beat within [`HEARTBEAT_TIMEOUT`] (judged from this
    /// launcher's clock: counters, not timestamps, cross the network).
    pub fn alive(&mut self, agents: &mut Agents, node: usize) -> Result<bool> {
        let beats = agents.beats_of(node)?;
        let now = Instant::now();
        let e = self.seen.entry(node).or_insert((beats, now));
        if e.0 != beats {
            *e = (beats, now);
        }
        Ok(beats > 0 && now.duration_since(e.1) < HEARTBEAT_TIMEOUT)
    }
}

/// The members of a round over `nodes` (node, slots) in node order, giving ranks to the first
/// nodes' slots until `world` are placed, in whole units of `unit` consecutive ranks (the
/// layout's `tp · cp`, so that no tensor- or context-parallel group spans two nodes): a node's
/// slots beyond a whole number of units stay idle.
pub fn assign(nodes: &[(usize, usize)], world: usize, unit: usize) -> Vec<Member> {
    let unit = unit.max(1);
    let mut next = 0;
    nodes
        .iter()
        .map(|&(node, slots)| {
            let nproc = (slots / unit * unit).min(world - next);
            let m = Member {
                node,
                slots,
                first_rank: next,
                nproc,
            };
            next += nproc;
            m
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_fill_the_first_nodes_slots() {
        let m = assign(&[(0, 2), (1, 2), (3, 1)], 4, 1);
        let got: Vec<_> = m.iter().map(|m| (m.node, m.first_rank, m.nproc)).collect();
        assert_eq!(got, [(0, 0, 2), (1, 2, 2), (3, 4, 0)]);
        let m = assign(&[(0, 1), (2, 2)], 3, 1);
        let got: Vec<_> = m.iter().map(|m| (m.node, m.first_rank, m.nproc)).collect();
        assert_eq!(got, [(0, 0, 1), (2, 1, 2)]);
    }

    #[test]
    fn ranks_go_to_nodes_in_whole_tensor_parallel_units() {
        // A node that lost one of its 4 GPUs keeps 2 ranks of tp 2; the third slot stays idle,
        // where filling it would split the group {2, 3} across nodes.
        let m = assign(&[(0, 3), (1, 4)], 6, 2);
        let got: Vec<_> = m.iter().map(|m| (m.node, m.first_rank, m.nproc)).collect();
        assert_eq!(got, [(0, 0, 2), (1, 2, 4)]);
    }

    #[test]
    fn launchers_meet_and_read_one_plan() {
        let server = StoreServer::start("127.0.0.1:0", "t", Duration::from_secs(5)).unwrap();
        let addr = server.addr().to_string();
        let mut zero = Agents::connect(0, None, &addr, "t").unwrap();
        let mut one = Agents::connect(1, None, &addr, "t").unwrap();
        assert_eq!(one.first_round().unwrap(), 0);
        one.register(0, 2).unwrap();
        zero.register(0, 2).unwrap();
        assert_eq!(zero.registered(0).unwrap(), [(0, 2), (1, 2)]);
        let plan = Plan {
            round: 0,
            world: 4,
            port: 1234,
            token: "x".into(),
            overrides: None,
            members: assign(&[(0, 2), (1, 2)], 4, 1),
            failures: 0,
            error: None,
        };
        zero.publish(&plan).unwrap();
        let got = one.plan(0).unwrap();
        assert_eq!(got.member(1).unwrap().first_rank, 2);
        // A launcher that returns joins the round after the newest.
        assert_eq!(one.first_round().unwrap(), 1);
        assert!(!one.stop_asked(0).unwrap());
        zero.ask_stop(0).unwrap();
        assert!(one.stop_asked(0).unwrap());
        let report = Report {
            outcome: Outcome::Failed,
            lost: vec![3],
            message: "rank 3 failed".into(),
        };
        one.report(0, &report).unwrap();
        assert_eq!(zero.report_of(0, 1).unwrap().unwrap().lost, [3]);
        assert!(zero.report_of(0, 2).unwrap().is_none());
        let mut live = Liveness::default();
        assert!(live.alive(&mut zero, 1).unwrap());
        assert!(!live.alive(&mut zero, 5).unwrap(), "never beat");
    }
}
