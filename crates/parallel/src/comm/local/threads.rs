//! [`run_local`]: runs the ranks of a job as threads of this process over a [`LocalWorld`],
//! turning any rank's error or panic into a prompt, job-wide failure and reporting its root cause
//! with the rank's own error (its type and causes kept).

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use super::LocalWorld;
use crate::comm::Comm;

/// What went wrong with a rank thread itself (rather than inside the rank's work).
#[derive(Debug, thiserror::Error)]
pub enum ThreadError {
    /// The rank panicked; the payload's text.
    #[error("panicked: {0}")]
    Panicked(String),
    /// The rank's thread could not be started.
    #[error("cannot spawn its thread: {0}")]
    Spawn(std::io::Error),
}

impl From<ThreadError> for candle_core::Error {
    fn from(e: ThreadError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// The root cause of a failed job: the first rank that failed and its own error (never the
/// secondary "peer failed" errors of the ranks it stopped).
#[derive(Debug)]
pub struct RankFailed<E> {
    /// The rank.
    pub rank: usize,
    /// Its error.
    pub error: E,
}

impl<E> fmt::Display for RankFailed<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} failed", self.rank)
    }
}

impl<E: std::error::Error + 'static> std::error::Error for RankFailed<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// Runs `f(rank, comm)` on `world_size` threads named `rank-{r}`, sharing a [`LocalWorld`] whose
/// waits give up after `timeout`, and returns the results in rank order.
///
/// If a rank returns `Err` or panics, its communicator is aborted with that error's text, so the
/// other ranks' pending and later operations end promptly with `PeerFailed` errors. The job then
/// fails with [`RankFailed`] holding the first failed rank's own error; a panic or a thread that
/// cannot start becomes the rank's error through `E: From<ThreadError>`.
pub fn run_local<T, E, F>(
    world_size: usize,
    timeout: Duration,
    f: F,
) -> Result<Vec<T>, RankFailed<E>>
where
    T: Send,
    E: From<ThreadError> + fmt::Display + Send,
    F: Fn(usize, Arc<dyn Comm>) -> Result<T, E> + Sync,
{
    let comms = LocalWorld::new(world_size, timeout);
    let f = &f;
    let outcomes: Vec<Result<T, E>> = std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(world_size);
        for (rank, own) in comms.iter().enumerate() {
            let comm = own.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn_scoped(scope, move || {
                    let dyn_comm: Arc<dyn Comm> = comm.clone();
                    let outcome = catch_unwind(AssertUnwindSafe(|| f(rank, dyn_comm)))
                        .unwrap_or_else(|payload| {
                            Err(ThreadError::Panicked(panic_message(&*payload)).into())
                        });
                    if let Err(e) = &outcome {
                        comm.abort(&format!("{e:#}"));
                    }
                    outcome
                });
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    // Stop the ranks already started, then report the spawn failure.
                    let e = E::from(ThreadError::Spawn(e));
                    own.abort(&format!("{e:#}"));
                    let mut out: Vec<Result<T, E>> =
                        handles.into_iter().map(|h| join(h.join())).collect();
                    out.push(Err(e));
                    return out;
                }
            }
        }
        handles.into_iter().map(|h| join(h.join())).collect()
    });
    // The root cause is the first recorded failure; without one, the first error in rank order.
    let first_failed = comms
        .first()
        .and_then(|c| c.failure())
        .map(|(rank, _)| rank);
    let mut values = Vec::with_capacity(world_size);
    let mut failed: Option<RankFailed<E>> = None;
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Ok(v) => values.push(v),
            Err(error) if failed.is_none() || first_failed == Some(rank) => {
                failed = Some(RankFailed { rank, error });
            }
            Err(_) => {}
        }
    }
    failed.map_or(Ok(values), Err)
}

/// The outcome of a joined rank thread (its panics are caught inside, so a join error is rare).
fn join<T, E: From<ThreadError>>(joined: std::thread::Result<Result<T, E>>) -> Result<T, E> {
    joined.unwrap_or_else(|payload| Err(ThreadError::Panicked(panic_message(&*payload)).into()))
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
