//! The flight recorder end to end: a rank process stopped with SIGSTOP under `--nproc-per-node`
//! is named by the launcher, with the operation it never entered and its last one, within
//! `parallel.timeout_s` + 10 s; SIGUSR1 to the launcher reports without stopping the job; thread
//! ranks report a rank too slow for the timeout the same way.

use std::process::Command;
use std::time::{Duration, Instant};

mod common;
use common::job::Job;

#[test]
fn a_stopped_rank_is_named_with_the_operation_it_never_entered() {
    let dir = tempfile::tempdir().unwrap();
    let timeout_s = 5;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pretrain"));
    cmd.args([
        "--nproc-per-node",
        "4",
        "--recipe",
        "recipes/tiny.yaml",
        "--set",
    ])
    .arg(format!(
        "parallel.dp=2,parallel.tp=2,train.steps=500,train.eval_interval=0,\
             checkpoint.interval=0,run.log_interval=1,parallel.timeout_s={timeout_s},run.dir={}",
        dir.path().display()
    ));
    // Rank 3 is made the slowest (a pause in each forward action), so the others wait for it
    // and SIGSTOP finds it computing, not inside a collective it has entered (which the
    // records would show as entered: a stop there names it waiting, not missing).
    cmd.env("PRETRAIN_TEST_SLOW_RANK", "3:300");
    let mut job = Job::start(cmd);
    assert!(job.wait_for("step=2/"), "{}", job.log);
    // SIGUSR1: the launcher reports what the ranks do; the job goes on.
    job.signal(libc::SIGUSR1);
    assert!(job.wait_for("flight recorder:"), "{}", job.log);
    assert!(job.wait_for("step=4/"), "{}", job.log);
    job.signal_rank(3, libc::SIGSTOP);
    let stopped = Instant::now();
    let (status, log) = job.finish();
    let elapsed = stopped.elapsed();
    assert!(!status.success(), "{log}");
    assert!(
        elapsed < Duration::from_secs(timeout_s + 10),
        "the job took {elapsed:?} to stop after rank 3 was stopped:\n{log}"
    );
    // The launcher names the rank that hung as the root cause, not those that timed out.
    assert!(log.contains("rank 3 hung: still running"), "{log}");
    let report = log.split("flight recorder:").last().unwrap_or_default();
    assert!(
        report.contains("rank 3 never entered") && report.contains("its last operation was"),
        "{log}"
    );
    // Its peers are named waiting in an operation over a group holding rank 3.
    assert!(
        report.contains("wait in ") || report.contains("waits in "),
        "{log}"
    );
    // The records are files anyone can read after the job.
    let rec = std::fs::read_to_string(dir.path().join("flight/rank-00003.flight")).unwrap();
    assert!(
        rec.contains("\"op\":\"all_reduce\""),
        "{}",
        &rec[..rec.len().min(2000)]
    );
}

/// Thread ranks: rank 1 pauses longer than the timeout in its forward; rank 0 times out in the
/// step's collective, and the report names rank 1 as the one that entered it too late.
#[test]
fn thread_ranks_report_the_rank_that_did_not_arrive() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args(["--recipe", "recipes/tiny.yaml", "--set"])
        .arg(format!(
            "parallel.dp=2,train.steps=3,train.eval_interval=0,parallel.timeout_s=2,run.dir={}",
            dir.path().display()
        ))
        .env("PRETRAIN_TEST_SLOW_RANK", "1:4000")
        .output()
        .unwrap();
    let log = common::cli::text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("flight recorder:"), "{log}");
    assert!(
        log.contains("rank 0 waits in all_reduce #")
            && log.contains("rank 1 entered it")
            && log.contains("too late"),
        "{log}"
    );
}

/// Without a launcher of ours (torchrun- or Slurm-style processes), rank 0 reports from the
/// records it can read when it times out: here rank 1 is stopped, and rank 0 names it. Rank 1
/// is made the slower one (a second in each forward, two a step: the stop, sent once rank 0
/// logs step 2, finds it computing even when a loaded machine delays the signal), rather than
/// inside a collective it has entered (which the records would show as entered, not missing).
/// Rank 0 waits at most those two seconds for it, within the 3 s timeout.
#[test]
fn rank_zero_reports_under_another_launcher() {
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
                 run.log_interval=1,parallel.timeout_s=3,run.dir={}",
                dir.path().display()
            ))
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("PRETRAIN_JOB_TOKEN", "flight-test")
            .env("PRETRAIN_TEST_SLOW_RANK", "1:1000");
        cmd
    };
    let mut first = Job::start(rank(0));
    let mut second = rank(1)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert!(first.wait_for("step=2/"), "{}", first.log);
    // SAFETY: kill(2) on the rank process this test started.
    unsafe { libc::kill(second.id() as i32, libc::SIGSTOP) };
    let (status, log) = first.finish();
    // SAFETY: as above; the stopped process is ended.
    unsafe { libc::kill(second.id() as i32, libc::SIGKILL) };
    second.wait().unwrap();
    assert_eq!(status.code(), Some(4), "a timed-out rank exits 4:\n{log}");
    assert!(log.contains("flight recorder:"), "{log}");
    assert!(log.contains("rank 1 never entered it"), "{log}");
}
