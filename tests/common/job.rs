//! A `--nproc-per-node` job started from a test: its output read line by line as it comes, its
//! rank processes found by rank and signalled.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// The pid of the child of `parent` whose environment has `RANK=rank`.
pub fn rank_pid(parent: u32, rank: usize) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_string_lossy().parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Field 4 (after the parenthesised command name) is the parent pid.
        let ppid: u32 = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let want = format!("RANK={rank}");
        (ppid == parent && env.split(|&b| b == 0).any(|v| v == want.as_bytes())).then_some(pid)
    })
}

/// A running launcher and everything it printed so far.
pub struct Job {
    child: Child,
    lines: Receiver<String>,
    /// Its output so far, stdout and stderr interleaved as read.
    pub log: String,
}

impl Job {
    /// Starts `cmd` with both streams read.
    pub fn start(mut cmd: Command) -> Self {
        let mut child = cmd
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = channel();
        let streams: [Box<dyn Read + Send>; 2] = [
            Box::new(child.stdout.take().unwrap()),
            Box::new(child.stderr.take().unwrap()),
        ];
        for stream in streams {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
        }
        Self {
            child,
            lines,
            log: String::new(),
        }
    }

    /// Reads output until a line contains `needle` (true) or the output ends or two minutes
    /// pass (false).
    pub fn wait_for(&mut self, needle: &str) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(120) {
            match self.lines.recv_timeout(Duration::from_secs(1)) {
                Ok(l) => {
                    let found = l.contains(needle);
                    self.log.push_str(&l);
                    self.log.push('\n');
                    if found {
                        return true;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        }
        false
    }

    /// Sends `signal` to the launcher.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on the child process this test started.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Sends `signal` to the job's rank `rank`.
    pub fn signal_rank(&self, rank: usize, signal: i32) {
        let pid = rank_pid(self.child.id(), rank).expect("the rank's process");
        // SAFETY: kill(2) on a rank process of the job this test started.
        unsafe { libc::kill(pid as i32, signal) };
    }

    /// Kills the launcher and its rank processes at once (SIGKILL), as a node that dies.
    pub fn kill_all(&self) {
        let parent = self.child.id();
        let children: Vec<u32> = (0..64).filter_map(|r| rank_pid(parent, r)).collect();
        for pid in children.into_iter().chain([parent]) {
            // SAFETY: kill(2) on the launcher this test started and its rank processes.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }

    /// Reads the rest of the output and waits for the launcher.
    pub fn finish(mut self) -> (ExitStatus, String) {
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(120)) {
            self.log.push_str(&l);
            self.log.push('\n');
        }
        let status = self.child.wait().unwrap();
        (status, self.log)
    }
}
