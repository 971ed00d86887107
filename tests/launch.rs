//! Multi-process jobs on loopback: `--nproc-per-node` starts rank processes that rendezvous through
//! the store and train over the `tcp` backend exactly like thread-ranks (bit-identical losses);
//! torchrun-style environments are checked against the recipe; a rank killed mid-run fails the
//! whole job promptly with an error naming it, and a rank whose teardown then hangs still ends at
//! its exit deadline.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pretrain::recipe;

mod common;
use common::job::rank_pid;

const LAYOUT: &str = "parallel.dp=2,parallel.pp=2,train.steps=3,schedule.warmup_steps=1,\
                      train.eval_interval=0,checkpoint.interval=0,run.log_interval=1";

/// One multi-process job at a time in this file: the tests pick free ports by binding port 0 and
/// letting it go, which another job's processes could take in between, and on two cores several
/// jobs at once only slow each other down.
fn one_job() -> std::sync::MutexGuard<'static, ()> {
    static JOBS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    JOBS.lock().unwrap_or_else(|e| e.into_inner())
}

fn losses(dir: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| v.get("loss")?.as_f64())
        .collect()
}

#[test]
fn processes_train_exactly_like_threads() {
    let _one = one_job();
    // Plain data parallelism with a pipeline, ZeRO-3 (gathers and reduce-scatters on each rank's
    // communication thread beside the pipeline's traffic), the context-parallel ring (K/V
    // blocks sent point to point around each pair) with data parallelism, and experts split
    // over data-parallel ranks.
    for layout in [
        LAYOUT.to_string(),
        format!("{LAYOUT},parallel.zero=3"),
        LAYOUT.replace("parallel.pp=2", "parallel.cp=2"),
        // Expert parallelism: tokens exchanged by all-to-all (point to point) in every MoE
        // layer's forward and backward, beside the pipeline's and the gradient sync's traffic.
        format!(
            "{LAYOUT},model.num_local_experts=4,model.intermediate_size=192,parallel.ep=2,parallel.zero=1"
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_pretrain"))
            .args([
                "--nproc-per-node",
                "4",
                "--recipe",
                "recipes/tiny.yaml",
                "--set",
            ])
            .arg(&layout)
            .arg("--set")
            .arg(format!("run.dir={}", dir.path().display()))
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stderr).to_string()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{layout}: launcher failed:\n{log}");
        let procs = losses(dir.path());

        let r = recipe::load(
            Path::new("recipes/tiny.yaml"),
            std::slice::from_ref(&layout),
        )
        .unwrap();
        let threads: Vec<f64> = pretrain::train::train(r, false)
            .unwrap()
            .records
            .iter()
            .map(|s| s.loss)
            .collect();
        assert_eq!(procs.len(), 3);
        assert_eq!(
            procs, threads,
            "{layout}: process ranks must equal thread ranks bit for bit"
        );
    }
}

#[test]
fn a_torchrun_environment_must_match_the_recipe() {
    let out = Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args(["--recipe", "recipes/tiny.yaml", "--set", "parallel.dp=2"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "3")
        .env("MASTER_ADDR", "127.0.0.1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("2 ranks, but the torchrun launcher started 3 processes (WORLD_SIZE)"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args(["--recipe", "recipes/tiny.yaml"])
        .env("RANK", "0")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("RANK is set but WORLD_SIZE is not"), "{err}");
}

#[test]
fn a_killed_rank_fails_the_job_promptly() {
    let _one = one_job();
    let dir = tempfile::tempdir().unwrap();
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args([
            "--nproc-per-node",
            "2",
            "--recipe",
            "recipes/tiny.yaml",
            "--set",
        ])
        .arg(format!(
            "parallel.dp=2,train.steps=500,train.eval_interval=0,checkpoint.interval=0,\
             run.log_interval=1,parallel.timeout_s=600,run.dir={}",
            dir.path().display()
        ))
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(launcher.stdout.take().unwrap()).lines();
    // Wait until training runs, then kill rank 1 without warning.
    for line in lines.by_ref() {
        if line.unwrap().contains("step=2/") {
            break;
        }
    }
    let victim = rank_pid(launcher.id(), 1).expect("rank 1 process");
    let killed_at = Instant::now();
    Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    for _ in lines {}
    let status = launcher.wait().unwrap();
    let elapsed = killed_at.elapsed();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(err.contains("rank 1 was killed (signal: 9"), "{err}");
    // Rank 0 noticed the lost connection by itself (it did not wait for the 600 s timeout).
    assert!(err.contains("rank 1 failed: connection lost"), "{err}");
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
}

/// Two rank processes of a dp 2 tiny job, started torchrun-style (`RANK`, `WORLD_SIZE`, ...) with
/// `timeout_s` and the extra environment `env`; rank 1 is killed once rank 0 logged step 2.
/// Rank 0's exit status, its stderr, and the time from the kill to its exit.
fn kill_a_peer(
    timeout_s: u32,
    env: &[(&str, &str)],
) -> (std::process::ExitStatus, String, Duration) {
    let _one = one_job();
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let rank = |r: usize| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pretrain"));
        cmd.args(["--recipe", "recipes/tiny.yaml", "--set"])
            .arg(format!(
                "parallel.dp=2,train.steps=500,train.eval_interval=0,checkpoint.interval=0,\
                 run.log_interval=1,parallel.timeout_s={timeout_s},run.dir={}",
                dir.path().display()
            ))
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("PRETRAIN_JOB_TOKEN", "kill-a-peer-test")
            .env("RUST_LOG", "info")
            .envs(env.iter().copied());
        // Rank 0's output is read; rank 1's goes nowhere (an unread pipe could fill and stall it).
        let out = |piped: bool| if piped { Stdio::piped() } else { Stdio::null() };
        cmd.stdout(out(r == 0)).stderr(out(r == 0));
        cmd.spawn().unwrap()
    };
    let mut first = rank(0);
    let mut second = rank(1);
    let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        if line.unwrap().contains("step=2/") {
            break;
        }
    }
    second.kill().unwrap();
    second.wait().unwrap();
    let killed_at = Instant::now();
    for _ in lines {}
    let status = first.wait().unwrap();
    let elapsed = killed_at.elapsed();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut first.stderr.take().unwrap(), &mut err).unwrap();
    (status, err, elapsed)
}

/// A rank stopped by a peer's failure exits with the follower status (3), so that launchers can
/// tell the root cause from the ranks that followed it; the status comes from the error's type.
#[test]
fn a_rank_stopped_by_a_dead_peer_exits_with_the_follower_status() {
    let (status, err, _) = kill_a_peer(600, &[]);
    assert_eq!(status.code(), Some(3), "{err}");
    assert!(err.contains("rank 1 failed"), "{err}");
    // The communication error names the rank once.
    assert!(!err.contains("rank 0: rank 0:"), "{err}");
}

/// A rank process whose job failed ends within its exit deadline even when its own teardown
/// hangs (simulated by `PRETRAIN_TEST_STUCK_AFTER_FAILURE`): it says so and exits with the
/// follower status, its peer having failed first.
#[test]
fn a_rank_stuck_after_the_job_failed_exits_at_the_deadline() {
    let (status, err, elapsed) = kill_a_peer(3, &[("PRETRAIN_TEST_STUCK_AFTER_FAILURE", "1")]);
    assert_eq!(status.code(), Some(3), "{err}");
    assert!(
        err.contains("rank 0: still running 3 s after the job failed (rank 1: connection lost"),
        "{err}"
    );
    // The deadline (3 s) after the failure, not the hang.
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
}

/// A free loopback port (see `one_job`).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The launcher of "node" `node` of a 2-node job meeting at `port`: `nproc` ranks of the tiny
/// recipe with `set` (and `run.dir=dir`); its output piped.
fn node(nproc: usize, node: usize, port: u16, dir: &Path, set: &str) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args(["--nproc-per-node", &nproc.to_string(), "--nnodes", "2"])
        .args([
            "--node-rank",
            &node.to_string(),
            "--master-addr",
            "127.0.0.1",
        ])
        .args(["--master-port", &port.to_string()])
        .args(["--recipe", "recipes/tiny.yaml", "--set", set, "--set"])
        .arg(format!("run.dir={}", dir.display()))
        .env("PRETRAIN_JOB_TOKEN", "launches-test")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn output(c: std::process::Child) -> (std::process::ExitStatus, String) {
    let out = c.wait_with_output().unwrap();
    let log =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    (out.status, log)
}

/// Node 0 launched for 2 ranks per node (world 4), node 1 for 1 (world 2, its recipe's dp=2):
/// both fail at once, each naming both launches, long before the 60 s timeout.
#[test]
fn launchers_that_disagree_fail_at_once_on_every_node() {
    let _one = one_job();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let set = "train.steps=2,train.eval_interval=0,train.global_batch=16,train.micro_batch=2,\
               parallel.timeout_s=60";
    let t = Instant::now();
    let zero = node(2, 0, port, dir.path(), &format!("{set},parallel.dp=4"));
    let one = node(1, 1, port, dir.path(), &format!("{set},parallel.dp=2"));
    let ((s0, log0), (s1, log1)) = (output(zero), output(one));
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t.elapsed()
    );
    assert!(!s0.success() && !s1.success(), "{log0}\nnode 1:\n{log1}");
    for log in [&log0, &log1] {
        assert!(log.contains("the launches disagree: "), "{log}");
        assert!(
            log.contains("node 1 at 127.0.0.1 (launcher pid ")
                && log.contains("with --nnodes 2 --nproc-per-node 1 runs 2 ranks")
                && log.contains("with --nnodes 2 --nproc-per-node 2 runs 4 ranks"),
            "{log}"
        );
        assert!(!log.contains("did not connect in time"), "{log}");
    }
    // Node 0's ranks only followed node 1's finding.
    assert!(
        log0.contains("the job cannot start (rank 1 found it)"),
        "{log0}"
    );
}

/// Two launchers given `--node-rank 1`: the second to check in is refused at once, naming the
/// first; the job runs on the first and finishes.
#[test]
fn a_node_rank_given_twice_is_refused() {
    let _one = one_job();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let set = "parallel.dp=2,train.steps=2,train.eval_interval=0,checkpoint.interval=0";
    let zero = node(1, 0, port, dir.path(), set);
    let a = node(1, 1, port, dir.path(), set);
    let b = node(1, 1, port, dir.path(), set);
    let (s0, log0) = output(zero);
    let ones = [output(a), output(b)];
    assert!(s0.success(), "{log0}");
    let refused: Vec<_> = ones.iter().filter(|(s, _)| !s.success()).collect();
    assert_eq!(refused.len(), 1, "{ones:?}");
    let log = &refused[0].1;
    assert!(
        log.contains("--node-rank 1 is taken by another launcher: node 1 at 127.0.0.1"),
        "{log}"
    );
}

/// `--nproc-per-node` inside a torchrun rank starts nothing.
#[test]
fn a_torchrun_rank_starts_no_job_of_its_own() {
    let out = Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args(["--nproc-per-node", "2", "--recipe", "recipes/tiny.yaml"])
        .args(["--set", "parallel.dp=2"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("TORCHELASTIC_RUN_ID", "none")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already is a rank of a launched job (TORCHELASTIC_RUN_ID=none set"),
        "{err}"
    );
}
