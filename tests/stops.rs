//! Stops through the binary: SIGTERM (one process, and a launcher with its ranks) finishes the
//! step, saves once and exits 128 + signal, and the run resumes from that checkpoint bit for bit;
//! a second signal well after the first ends a run blocked in its step at once.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use ckpt::Checkpoint;

mod common;
use common::short::{losses, masters, output, pretrain, start_until, stderr, step_dirs};

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on a child of this process that has not been reaped.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
}

/// Processes whose command line mentions `needle` (this test's unique run directory).
fn processes_mentioning(needle: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            if String::from_utf8_lossy(&cmd).contains(needle) {
                found.push(pid);
            }
        }
    }
    found
}

/// A signal that arrives while the run validates stops it after the validation, not after the
/// next step and its validation: a scheduler's grace period covers at most one validation.
#[test]
fn sigterm_during_a_validation_stops_after_it() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let set = "train.steps=6,train.eval_interval=1,train.eval_batches=200,checkpoint.interval=0";
    let mut child = start_until(pretrain(&run, set), "step=1/");
    signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}");
    let saved = step_dirs(&run);
    assert_eq!(saved, ["step-00000001"], "saved after step 1's validation");
}

#[test]
fn sigterm_saves_once_and_resume_auto_continues_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let (clean, stopped) = (tmp.path().join("clean"), tmp.path().join("stopped"));
    let set = "train.steps=8,checkpoint.interval=0,checkpoint.resume=auto";
    assert!(
        output(pretrain(&clean, &format!("{set},checkpoint.interval=8")))
            .status
            .success()
    );

    let mut child = start_until(pretrain(&stopped, set), "step=3/");
    signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}");
    let saved = step_dirs(&stopped);
    assert_eq!(saved.len(), 1, "one checkpoint on the way out: {saved:?}");

    let o = output(pretrain(&stopped, &format!("{set},checkpoint.interval=8")));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        losses(&stopped),
        losses(&clean),
        "each step once, same losses"
    );
    let last = "checkpoints/step-00000008";
    assert_eq!(masters(&stopped.join(last)), masters(&clean.join(last)));
}

#[test]
fn the_launcher_forwards_sigterm_and_its_ranks_never_outlive_it() {
    let tmp = tempfile::tempdir().unwrap();
    for (n, sig) in [(0, libc::SIGTERM), (1, libc::SIGKILL)] {
        let dir = tmp.path().join(format!("run{n}"));
        let mut cmd = pretrain(&dir, "train.steps=200,parallel.dp=2");
        cmd.args(["--nproc-per-node", "2"]);
        let mut launcher = start_until(cmd, "step=2/");
        let needle = format!("run.dir={}", dir.display());
        assert_eq!(processes_mentioning(&needle).len(), 3, "launcher + 2 ranks");
        signal(&launcher, sig);
        let status = launcher.wait().unwrap();
        if sig == libc::SIGTERM {
            assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}");
        }
        // SIGTERM: forwarded. SIGKILL: the kernel sends each rank SIGTERM as its parent dies.
        // Either way every rank saves and exits.
        let deadline = Instant::now() + Duration::from_secs(60);
        while !processes_mentioning(&needle).is_empty() {
            assert!(Instant::now() < deadline, "ranks left running after {sig}");
            std::thread::sleep(Duration::from_millis(100));
        }
        let latest = std::fs::read_to_string(dir.join("checkpoints/latest")).unwrap();
        Checkpoint::open(&dir.join("checkpoints").join(latest.trim())).unwrap();
    }
}

/// A step blocked where it cannot end (here a forward paused for a minute): the first SIGTERM
/// waits for the step; a second one soon after changes nothing (a scheduler and a launcher
/// delivering the same stop); one `REPEAT_AFTER` later ends the run at once with 143 and no
/// checkpoint — one process, and a launcher, which ends its rank.
#[test]
fn a_second_sigterm_ends_a_blocked_run_at_once() {
    let after = pretrain::job::signals::REPEAT_AFTER;
    for launched in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let mut cmd = pretrain(&dir, "train.steps=4,checkpoint.interval=0");
        cmd.env("PRETRAIN_TEST_SLOW_RANK", "0:60000");
        if launched {
            cmd.args(["--nproc-per-node", "1"]);
        }
        let mut child = start_until(cmd, "model:");
        let start = Instant::now();
        signal(&child, libc::SIGTERM);
        std::thread::sleep(Duration::from_millis(200));
        signal(&child, libc::SIGTERM);
        std::thread::sleep(after + Duration::from_secs(1));
        assert!(child.try_wait().unwrap().is_none(), "still in its step");
        signal(&child, libc::SIGTERM);
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}");
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{:?}",
            start.elapsed()
        );
        assert!(!dir.join("checkpoints/latest").exists(), "nothing saved");
        let needle = format!("run.dir={}", dir.display());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !processes_mentioning(&needle).is_empty() {
            assert!(Instant::now() < deadline, "a rank outlived its launcher");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A rank that received SIGTERM directly (not through the launcher) stops the job
/// after a step like a forwarded one: every rank saves and exits 143, and the launcher reports a
/// stop, not a failed rank.
#[test]
fn a_rank_stopped_directly_is_a_stop_not_a_failure() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let mut cmd = pretrain(&dir, "train.steps=200,parallel.dp=2");
    cmd.args(["--nproc-per-node", "2"]).stderr(Stdio::piped());
    let mut launcher = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let mut out = BufReader::new(launcher.stdout.take().unwrap()).lines();
    while !out.next().unwrap().unwrap().contains("step=2/") {}
    std::thread::spawn(move || out.for_each(drop));
    let needle = format!("run.dir={}", dir.display());
    let rank = processes_mentioning(&needle)
        .into_iter()
        .find(|&p| p != launcher.id())
        .unwrap();
    // SAFETY: kill(2) on a rank process of this test's launcher.
    assert_eq!(unsafe { libc::kill(rank as libc::pid_t, libc::SIGTERM) }, 0);
    let o = launcher.wait_with_output().unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(128 + libc::SIGTERM), "{e}");
    assert!(!e.contains("failed"), "{e}");
    let latest = std::fs::read_to_string(dir.join("checkpoints/latest")).unwrap();
    Checkpoint::open(&dir.join("checkpoints").join(latest.trim())).unwrap();
}
