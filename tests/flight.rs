//! The flight recorder end to end: a rank process stopped with SIGSTOP under `--nproc-per-node`
//! is named by the launcher, with the operation it never entered and its last one, within
//! `parallel.timeout_s` + 10 s; SIGUSR1 to the launcher reports without stopping the job; thread
//! ranks report a rank too slow for the timeout the same way.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The pid of the child of `parent` whose environment has `RANK=rank`.
fn rank_pid(parent: u32, rank: usize) -> Option<i32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // pid (comm) state ppid ...: the fields after the last ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid != Some(parent) {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let want = format!("RANK={rank}");
        if env.split(|&b| b == 0).any(|v| v == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

#[test]
fn a_stopped_rank_is_named_with_the_operation_it_never_entered() {
    let dir = tempfile::tempdir().unwrap();
    let timeout_s = 5;
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args([
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
        ))
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Everything the job prints, from both streams, line by line.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let mut readers = Vec::new();
    for stream in [
        Box::new(launcher.stdout.take().unwrap()) as Box<dyn Read + Send>,
        Box::new(launcher.stderr.take().unwrap()),
    ] {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        }));
    }
    drop(tx);
    let mut log = String::new();
    let wait_for = |needle: &str, log: &mut String| {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(120) {
            match rx.recv_timeout(Duration::from_secs(1)) {
                Ok(l) => {
                    log.push_str(&l);
                    log.push('\n');
                    if l.contains(needle) {
                        return true;
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(_) => return false,
            }
        }
        false
    };
    assert!(wait_for("step=2/", &mut log), "{log}");
    // SIGUSR1: the launcher reports what the ranks do; the job goes on.
    // SAFETY: kill(2) on the child process this test started.
    unsafe { libc::kill(launcher.id() as i32, libc::SIGUSR1) };
    assert!(wait_for("flight recorder:", &mut log), "{log}");
    assert!(wait_for("step=4/", &mut log), "{log}");
    let pid = rank_pid(launcher.id(), 3).expect("rank 3's process");
    // SAFETY: kill(2) on a rank process of the job this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stopped = Instant::now();
    while rx
        .recv_timeout(Duration::from_secs(60))
        .map(|l| {
            log.push_str(&l);
            log.push('\n');
        })
        .is_ok()
    {}
    let status = launcher.wait().unwrap();
    let elapsed = stopped.elapsed();
    for r in readers {
        r.join().unwrap();
    }
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
    let log =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("flight recorder:"), "{log}");
    assert!(
        log.contains("rank 0 waits in all_reduce #")
            && log.contains("rank 1 entered it")
            && log.contains("too late"),
        "{log}"
    );
}
