//! Elastic restart on one node: dp 2 × tp 2 on 4 rank processes with `--elastic 2:4`; a rank
//! SIGKILLed mid-run makes the launcher restart the job on the 3 slots left, on the layout the
//! planner picks for them, from the newest checkpoint. The job finishes every step (exit 0), each
//! step is in metrics.jsonl once, the steps after the restart equal a run that made the same
//! layout change by hand from the same checkpoint bit for bit, and the curve stays within 1e-3 of
//! the uninterrupted run's. A hung rank is the one taken out; too few ranks left is an error.
//! Across two "nodes" (two launchers on this machine): a node lost whole is left behind, and
//! the job grows back when its launcher returns; a node that loses one slot goes on across both.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use pretrain::launch::elastic::{relayout, Relayout};
use pretrain::recipe::load;

mod common;
use common::job::Job;

const SET: &str = "parallel.dp=2,parallel.tp=2,train.steps=8,train.global_batch=16,\
                   train.micro_batch=4,schedule.warmup_steps=1,train.eval_interval=0,\
                   checkpoint.interval=2,checkpoint.keep=10,run.log_interval=1,parallel.timeout_s=5";

fn records(dir: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("loss").is_some())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

/// Asserts that `got` holds steps 1 to `steps`, each once (`log`: the job's, for the message).
fn every_step_once(got: &[(u64, f64)], steps: u64, log: &str) {
    assert_eq!(
        got.iter().map(|r| r.0).collect::<Vec<_>>(),
        (1..=steps).collect::<Vec<_>>(),
        "every step once:\n{log}"
    );
}

/// The losses of `set` with the layout `next` resumed from `run`'s checkpoint of step `from`,
/// trained in this process (thread ranks train like processes, bit for bit).
fn by_hand(set: &str, next: &Relayout, run: &Path, from: u64) -> Vec<f64> {
    let ckpt = run.join(format!("checkpoints/step-{from:08}"));
    let recipe = load(
        Path::new("recipes/tiny.yaml"),
        &[
            set.to_string(),
            next.overrides(),
            format!("checkpoint.resume={}", ckpt.display()),
        ],
    )
    .unwrap();
    losses(recipe)
}

fn losses(mut recipe: pretrain::recipe::Recipe) -> Vec<f64> {
    // A run directory of its own: the tests of this file run these side by side.
    let dir = tempfile::tempdir().unwrap();
    recipe.run.dir = dir.path().join("run");
    pretrain::train::train(recipe, false)
        .unwrap()
        .records
        .iter()
        .map(|r| r.loss)
        .collect()
}

/// Each step of `got` within 1e-3 of the uninterrupted run of `recipe`.
fn near_uninterrupted(got: &[(u64, f64)], recipe: pretrain::recipe::Recipe) {
    for ((step, a), b) in got.iter().zip(&losses(recipe)) {
        assert!((a - b).abs() / b < 1e-3, "step {step}: {a} vs {b}");
    }
}

/// The launcher of a 4-rank job of the tiny recipe with `elastic` and SET, into `dir`.
fn launcher(elastic: &[&str], dir: &Path, extra: &str) -> Job {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pretrain"));
    cmd.args(["--nproc-per-node", "4"])
        .args(elastic)
        .args(["--recipe", "recipes/tiny.yaml", "--set", SET, "--set"])
        .arg(format!("run.dir={}{extra}", dir.display()));
    Job::start(cmd)
}

#[test]
fn a_lost_rank_restarts_the_job_on_the_ranks_left() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("elastic");
    let mut job = launcher(&["--elastic", "2:4", "--max-restarts", "1"], &run, "");
    assert!(job.wait_for("step=3/8"), "{}", job.log);
    job.signal_rank(3, libc::SIGKILL);
    let killed = Instant::now();
    let (status, log) = job.finish();
    let took = killed.elapsed();
    eprintln!("job finished {:.1} s after the kill", took.as_secs_f64());
    assert!(status.success(), "{log}");
    assert!(
        log.contains("elastic restart 1/1: rank 3 lost (3 ranks left: "),
        "{log}"
    );
    assert!(log.contains("training resumed"), "{log}");
    assert!(took < Duration::from_secs(120), "{log}");
    let got = records(&run);
    every_step_once(&got, 8, &log);

    // The same change by hand: the layout the planner picks for 3 ranks, from the checkpoint the
    // restart resumed from, as thread ranks (which train like processes, bit for bit).
    let base = vec![SET.to_string()];
    let recipe = load(Path::new("recipes/tiny.yaml"), &base).unwrap();
    let next = relayout(&recipe, &[3], 2).unwrap();
    assert!(log.contains(&next.describe()), "{log}");
    assert!(
        log.contains("resuming from the checkpoint of step 2"),
        "{log}"
    );
    let after: Vec<f64> = got[2..].iter().map(|r| r.1).collect();
    assert_eq!(
        after,
        by_hand(SET, &next, &run, 2),
        "the steps after the restart vs the same change by hand"
    );
    near_uninterrupted(&got, recipe);
}

/// Below the minimum, or with no restarts left, the job ends with an error naming it; a minimum
/// above the job's ranks is refused before anything starts.
#[test]
fn too_few_ranks_left_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let mut job = launcher(&["--elastic", "4"], tmp.path(), ",train.steps=50");
    assert!(job.wait_for("step=2/"), "{}", job.log);
    job.signal_rank(2, libc::SIGKILL);
    let (status, log) = job.finish();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("rank 2 lost: 3 ranks left, below the --elastic minimum 4"),
        "{log}"
    );
    // No restarts left.
    let mut job = launcher(
        &["--elastic", "2:4", "--max-restarts", "0"],
        tmp.path(),
        "/r,train.steps=50",
    );
    assert!(job.wait_for("step=2/"), "{}", job.log);
    job.signal_rank(1, libc::SIGKILL);
    let (status, log) = job.finish();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("rank 1 lost: --max-restarts 0 used up; not restarting again"),
        "{log}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args(["--nproc-per-node", "2", "--nnodes", "2", "--master-addr"])
        .args([
            "127.0.0.1",
            "--elastic",
            "5",
            "--recipe",
            "recipes/tiny.yaml",
        ])
        .args(["--set", SET])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && text.contains("--elastic minimum 5 exceeds the job's 4 ranks"),
        "{text}"
    );
}

/// A rank that hangs (SIGSTOP) is the one taken out: the others time out waiting for it, the
/// launcher kills it and restarts on the ranks left.
#[test]
fn a_hung_rank_is_the_one_taken_out() {
    let tmp = tempfile::tempdir().unwrap();
    let mut job = launcher(&["--elastic", "2"], tmp.path(), "");
    assert!(job.wait_for("step=3/8"), "{}", job.log);
    job.signal_rank(1, libc::SIGSTOP);
    let (status, log) = job.finish();
    assert!(status.success(), "{log}");
    assert!(log.contains("rank 1 hung: still running"), "{log}");
    assert!(
        log.contains("elastic restart 1/3: rank 1 lost (3 ranks left: "),
        "{log}"
    );
    assert_eq!(records(tmp.path()).len(), 8, "{log}");
}

/// The recipe overrides of a two-node job of `steps` steps into `run`, the free port it meets
/// at, and its two launchers, started (node 0 first).
fn two_nodes(run: &Path, steps: usize) -> (String, u16, Job, Job) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let set = format!("{SET},train.steps={steps},checkpoint.keep=100");
    let zero = node_launcher(0, port, run, &set);
    let one = node_launcher(1, port, run, &set);
    (set, port, zero, one)
}

/// A launcher of "node" `node` of a 2 × 2-rank job meeting at `port`, with `elastic`.
fn node_launcher(node: usize, port: u16, dir: &Path, set: &str) -> Job {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pretrain"));
    cmd.args(["--nproc-per-node", "2", "--nnodes", "2", "--node-rank"])
        .arg(node.to_string())
        .args(["--master-addr", "127.0.0.1", "--master-port"])
        .arg(port.to_string())
        .args(["--elastic", "2:4", "--max-restarts", "2"])
        .args(["--recipe", "recipes/tiny.yaml", "--set", set, "--set"])
        .arg(format!("run.dir={}", dir.display()))
        .env("PRETRAIN_JOB_TOKEN", "two-node-elastic-test")
        // Steps of at least 100 ms: time for the returning node to join before the end.
        .env("PRETRAIN_TEST_SLOW_RANK", "0:50");
    Job::start(cmd)
}

/// Two "nodes" of a dp 2 × tp 2 job, two rank processes each, `--elastic 2:4`: node 1 dies
/// whole (launcher and ranks SIGKILLed); node 0's launcher finds its heartbeat gone and goes on
/// on its own 2 ranks from the newest checkpoint; node 1's launcher started again registers, the
/// running round stops at the end of a step (saving), and the job grows back to 4 ranks. Every
/// step is in metrics.jsonl once; then node 1's launcher is stopped (SIGTERM, a drained node):
/// the job saves and finishes on node 0 (exit 0). Each round equals the same layout change made
/// by hand from its checkpoint bit for bit, and the curve stays within 1e-3 of the uninterrupted
/// run's.
#[test]
fn a_lost_node_is_left_behind_and_joins_again() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("nodes");
    let (set, port, mut zero, one) = two_nodes(&run, 40);
    assert!(zero.wait_for("step=3/40"), "{}", zero.log);
    one.kill_all();
    let killed = Instant::now();
    let (_, log_one) = one.finish();
    assert!(
        zero.wait_for("training resumed"),
        "{}\nnode 1:\n{log_one}",
        zero.log
    );
    eprintln!(
        "resumed on node 0 alone {:.1} s after node 1 died",
        killed.elapsed().as_secs_f64()
    );
    let one = node_launcher(1, port, &run, &set);
    assert!(zero.wait_for("node 1 joined"), "{}", zero.log);
    assert!(zero.wait_for("training resumed"), "{}", zero.log);
    // Node 1 drained (SIGTERM to its launcher): the job saves and goes on without it.
    one.signal(libc::SIGTERM);
    let (status, log) = zero.finish();
    let (status_one, log_one) = one.finish();
    assert!(status.success(), "{log}\nnode 1:\n{log_one}");
    assert_eq!(status_one.code(), Some(128 + libc::SIGTERM), "{log_one}");
    for l in log.lines().filter(|l| l.contains("elastic")) {
        eprintln!("node 0: {l}");
    }
    assert!(
        log.contains("elastic restart 1/2: node 1 lost (its launcher stopped answering; ranks 2-3) (2 ranks left)"),
        "{log}"
    );
    let base = load(Path::new("recipes/tiny.yaml"), std::slice::from_ref(&set)).unwrap();
    let two = relayout(&base, &[2], 2).unwrap();
    assert!(
        log.contains(&format!("restarting on {}", two.describe())),
        "{log}"
    );
    assert!(
        log.contains("elastic round 2: node 1 joined; restarting on 4 ranks: dp=2 tp=2"),
        "{log}"
    );
    let got = records(&run);
    every_step_once(&got, 40, &log);
    // Each round equals the same layout change made by hand from the checkpoint it resumed
    // from, as thread ranks, bit for bit: 2 ranks from the restart to the growth, 4 until the
    // drain, 2 after it.
    let resumed: Vec<u64> = log
        .lines()
        .filter_map(|l| l.split("resuming from the checkpoint of step ").nth(1))
        .map(|t| t.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    let [lost_at, grown_at, left_at] = resumed[..] else {
        panic!("three resumptions expected:\n{log}")
    };
    assert!(
        log.contains("elastic round 3: node 1 left; restarting on 2 ranks"),
        "{log}"
    );
    let four = relayout(&base, &[2, 2], 2).unwrap();
    let rounds = [
        (&two, lost_at, grown_at),
        (&four, grown_at, left_at),
        (&two, left_at, 40),
    ];
    for (next, from, to) in rounds {
        let hand = by_hand(&set, next, &run, from);
        let (a, b) = (from as usize, to as usize);
        let elastic: Vec<f64> = got[a..b].iter().map(|r| r.1).collect();
        assert_eq!(elastic, hand[..b - a], "steps {}..={to} by hand", from + 1);
    }
    near_uninterrupted(&got, base);
}

/// Two "nodes" of a dp 2 × tp 2 job, two rank processes each: one rank of node 1 is SIGKILLed
/// (a GPU lost, its node's launcher alive), so the nodes offer 2 and 1 slots. The restart takes
/// the planner's layout for those slots (on this recipe pp 3 over all three; a layout with
/// groups of 2 would leave node 1's odd slot idle, never split a group across the launchers),
/// both launchers finish, every step is in metrics.jsonl once, and the steps after the restart
/// equal the same layout change made by hand from the checkpoint bit for bit.
#[test]
fn a_node_that_loses_one_slot_keeps_tensor_parallel_groups_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("slot");
    let (set, _, mut zero, one) = two_nodes(&run, 12);
    assert!(zero.wait_for("step=3/12"), "{}", zero.log);
    one.signal_rank(3, libc::SIGKILL);
    let (status, log) = zero.finish();
    let (status_one, log_one) = one.finish();
    assert!(status.success(), "{log}\nnode 1:\n{log_one}");
    assert!(status_one.success(), "{log_one}");
    let base = load(Path::new("recipes/tiny.yaml"), std::slice::from_ref(&set)).unwrap();
    let next = relayout(&base, &[2, 1], 2).unwrap();
    assert!(
        log.contains("elastic restart 1/2: rank 3 lost (3 ranks left: ")
            && log.contains(&format!("restarting on {}", next.describe())),
        "{log}"
    );
    for l in log
        .lines()
        .chain(log_one.lines())
        .filter(|l| l.contains("elastic"))
    {
        eprintln!("{l}");
    }
    // With groups of 2 (tp or cp), node 1's one slot cannot hold a whole group: it idles.
    if next.layout.tp * next.layout.cp > 1 {
        assert!(
            log_one.contains("leaves node 1 idle"),
            "a tp 2 layout on 2 + 1 slots runs on node 0 alone:\n{log_one}"
        );
    }
    let got = records(&run);
    every_step_once(&got, 12, &log);
    let from: u64 = log
        .split("resuming from the checkpoint of step ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("a resumption expected:\n{log}"));
    let hand = by_hand(&set, &next, &run, from);
    let elastic: Vec<f64> = got[from as usize..].iter().map(|r| r.1).collect();
    assert_eq!(elastic, hand, "steps {}..=12 by hand", from + 1);
}
