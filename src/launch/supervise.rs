//! Supervising a node's rank processes: waiting for them, forwarding stop signals, and naming the
//! rank that failed first.

use std::path::Path;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::{PEER_FAILED_EXIT, TIMED_OUT_EXIT};

/// Waits for every child; after the first failure, gives the others `grace` to stop, then kills
/// them. The error names the root cause: the first failed rank that did not merely follow
/// another's failure (exit status [`PEER_FAILED_EXIT`]). The flight records of the job's `world`
/// ranks in `flight` say what the ranks were waiting in: logged at each SIGUSR1, and when the
/// job fails with a rank waiting in some operation. When `stop` returns true (an elastic job's
/// membership changes) the ranks are asked to stop as a stop signal asks them (SIGTERM).
pub(super) fn supervise(
    mut children: Vec<(usize, Child)>,
    grace: Duration,
    (flight, world): (&Path, usize),
    stop: &mut dyn FnMut() -> bool,
) -> Result<()> {
    let mut usr1 = crate::job::flight::usr1_count();
    // A rank that received a stop signal (through this launcher or directly) saves and exits
    // with 128 + the signal, and so do the others: the stop is agreed job-wide after a step.
    let stopped = |s: &ExitStatus| {
        crate::job::signals::STOP_SIGNALS
            .iter()
            .find(|&&sig| s.code() == Some(128 + sig))
            .copied()
    };
    let mut failures: Vec<(usize, ExitStatus)> = Vec::new();
    let mut hung: Vec<(usize, ExitStatus)> = Vec::new();
    let mut deadline: Option<Instant> = None;
    let mut forwarded: Option<i32> = None;
    while !children.is_empty() {
        let asked = crate::job::signals::pending().or_else(|| stop().then_some(libc::SIGTERM));
        if let (None, Some(sig)) = (forwarded, asked) {
            tracing::warn!(
                "{}: asking the ranks to finish their step, save and stop",
                crate::job::signals::name(sig)
            );
            for (_, c) in &children {
                // SAFETY: kill(2) on a child this process started and has not reaped.
                unsafe { libc::kill(c.id() as libc::pid_t, sig) };
            }
            forwarded = Some(sig);
        }
        // A second signal well after the first: the ranks may be blocked where their step
        // cannot end; they are ended at once, as the signal would end a rank process itself.
        if let Some(sig) = crate::job::signals::repeated() {
            tracing::warn!(
                "{} again: ending the ranks at once, without a checkpoint",
                crate::job::signals::name(sig)
            );
            for (_, c) in &mut children {
                let _ = c.kill();
                let _ = c.wait();
            }
            return Err(crate::job::signals::Interrupted {
                signal: sig,
                step: None,
                checkpoint: None,
                note: Some(
                    "the ranks were ended by a second signal; the last checkpoint saved stays \
                     loadable"
                        .into(),
                ),
            }
            .into());
        }
        if crate::job::flight::usr1_count() != usr1 {
            usr1 = crate::job::flight::usr1_count();
            crate::job::flight::report(&crate::job::flight::from_dir(flight, world));
        }
        let mut i = 0;
        while i < children.len() {
            let (rank, child) = &mut children[i];
            match child.try_wait() {
                Ok(Some(status)) => {
                    if !status.success() {
                        failures.push((*rank, status));
                        // A rank that stopped as asked is no failure to hurry the others for:
                        // they are saving too.
                        if stopped(&status).is_none() {
                            deadline.get_or_insert(Instant::now() + grace);
                        }
                    }
                    children.remove(i);
                }
                Ok(None) => i += 1,
                Err(e) => {
                    let msg = format!("waiting for rank {rank}: {e}");
                    for (_, c) in &mut children {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    bail!(msg);
                }
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            for (rank, c) in &mut children {
                tracing::warn!("killing rank {rank}, still running after another rank failed");
                let _ = c.kill();
                if let Ok(status) = c.wait() {
                    // A rank that hung while the others stopped may be the root cause.
                    hung.push((*rank, status));
                }
            }
            children.clear();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Stopped as asked: every rank that did not finish exited with 128 + a stop signal (the
    // one forwarded, or one a rank received directly).
    let signal = forwarded.or_else(|| failures.first().and_then(|(_, s)| stopped(s)));
    if let Some(signal) = signal {
        if hung.is_empty() && failures.iter().all(|(_, s)| stopped(s).is_some()) {
            return Err(crate::job::signals::Interrupted {
                signal,
                step: None,
                checkpoint: None,
                note: None,
            }
            .into());
        }
    }
    // The root cause: the first rank that failed on its own; else a rank that hung while every
    // failure was a follower's or a timeout waiting for it; else the first of those.
    let secondary = |s: &ExitStatus| {
        s.code() == Some(PEER_FAILED_EXIT as i32) || s.code() == Some(TIMED_OUT_EXIT as i32)
    };
    let root = failures
        .iter()
        .find(|(_, s)| !secondary(s))
        .or(hung.first())
        .or(failures.first());
    if root.is_some() {
        // What the ranks were waiting in when the job stopped (a rank that hung or was killed
        // left its record too).
        let d = crate::job::flight::from_dir(flight, world);
        if d.waits > 0 {
            crate::job::flight::report(&d);
        }
    }
    let hung_root = root.is_some_and(|r| hung.iter().any(|h| h.0 == r.0));
    // Whether the root failed (or hung) itself, or every rank here only followed a failure
    // elsewhere (another node's rank, in a job across nodes).
    let own = root.is_some_and(|(_, s)| hung_root || !secondary(s));
    match root {
        Some((rank, _)) if hung_root => Err(JobFailed {
            rank: *rank,
            own,
            message: format!(
                "rank {rank} hung: still running {:.0} s after the others stopped (they timed \
                 out waiting for it or followed), so it was killed",
                grace.as_secs_f64()
            ),
        }
        .into()),
        Some((rank, status)) if status.code().is_some() => Err(JobFailed {
            rank: *rank,
            own,
            message: format!("rank {rank} failed ({status}); see its error above"),
        }
        .into()),
        Some((rank, status)) => Err(JobFailed {
            rank: *rank,
            own,
            message: format!(
                "rank {rank} was killed ({status}) without reporting an error (out of memory? \
                 see the kernel log)"
            ),
        }
        .into()),
        None => Ok(()),
    }
}

/// A job that failed, and the rank at its root: the first that failed on its own (or hung).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct JobFailed {
    /// The rank.
    pub rank: usize,
    /// Whether it failed or hung itself; false when it only stopped because a rank elsewhere
    /// failed (a peer's failure, or a timeout waiting for one).
    pub own: bool,
    /// What happened to it.
    pub message: String,
}
