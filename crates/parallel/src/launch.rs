//! `run_local`: runs the ranks of a job as threads of this process over a
//! [`LocalWorld`](crate::comm::local::LocalWorld), turning any rank's error or panic into a
//! prompt, job-wide failure and reporting its root cause.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Error, Result};

use crate::comm::local::LocalWorld;
use crate::comm::Comm;

/// Runs `f(rank, comm)` on `world_size` threads named `rank-{r}`, sharing a [`LocalWorld`] whose
/// waits give up after `timeout`.
///
/// If a rank returns `Err` or panics, its communicator is aborted with that error, so the other
/// ranks' pending and later operations end promptly with `PeerFailed` errors. Returns the results
/// in rank order, or the *root cause*: the error of the first rank that failed, with context
/// `"rank R failed"` (its message reads `rank R failed` then the error on the next line), never
/// the secondary `PeerFailed` errors of the others. A panic becomes an error whose message is
/// `panicked: <payload>`.
pub fn run_local<T, F>(world_size: usize, timeout: Duration, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(usize, Arc<dyn Comm>) -> Result<T> + Sync,
{
    let comms = LocalWorld::new(world_size, timeout);
    let f = &f;
    let outcomes: Vec<Result<T>> = std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(world_size);
        for (rank, own) in comms.iter().enumerate() {
            let comm = own.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn_scoped(scope, move || {
                    let dyn_comm: Arc<dyn Comm> = comm.clone();
                    let outcome = catch_unwind(AssertUnwindSafe(|| f(rank, dyn_comm)))
                        .unwrap_or_else(|payload| {
                            Err(Error::msg(format!(
                                "panicked: {}",
                                panic_message(&*payload)
                            )))
                        });
                    if let Err(e) = &outcome {
                        comm.abort(&reason(e));
                    }
                    outcome
                });
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    // Stop the ranks already started, then report the spawn failure.
                    let msg = format!("cannot spawn thread rank-{rank}: {e}");
                    own.abort(&msg);
                    handles.into_iter().for_each(|h| drop(h.join()));
                    return vec![Err(Error::msg(msg))];
                }
            }
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::msg("rank thread panicked")))
            })
            .collect()
    });
    if outcomes.iter().all(|o| o.is_ok()) {
        return Ok(outcomes.into_iter().flatten().collect());
    }
    // The root cause is the first recorded failure; fall back to the first error in rank order.
    let first_failed = comms
        .first()
        .and_then(|c| c.failure())
        .map(|(rank, _)| rank);
    let root = first_failed
        .filter(|&r| outcomes.get(r).is_some_and(|o| o.is_err()))
        .or_else(|| outcomes.iter().position(|o| o.is_err()));
    let mut outcomes = outcomes;
    match root {
        Some(r) if outcomes.len() == world_size => match outcomes.swap_remove(r) {
            Err(e) => Err(e.context(format!("rank {r} failed"))),
            Ok(_) => Err(Error::msg("internal: root-cause rank succeeded")),
        },
        _ => match outcomes.into_iter().find_map(|o| o.err()) {
            Some(e) => Err(e),
            None => Err(Error::msg("internal: no error found")),
        },
    }
}

/// The message of `e` without captured backtraces (the abort reason other ranks report).
fn reason(e: &Error) -> String {
    match e {
        Error::WithBacktrace { inner, .. } => reason(inner),
        e => e.to_string(),
    }
}

/// The text of a panic payload (`&str` or `String`), or a placeholder.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic payload>".to_string()
    }
}
