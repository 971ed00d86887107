//! The flight recorder of a job (`parallel::comm::flight`): each rank's communicator is recorded
//! into `run.dir/flight/rank-NNNNN.flight` (in memory when a run writes no outputs). When a job
//! fails on a timeout, the diagnosis — which ranks wait in which operation, which rank never
//! entered it and what it did last — is logged: by the node's launcher (`--nproc-per-node`), by
//! the process running thread ranks, or by rank 0 under torchrun and Slurm. SIGUSR1 logs it at
//! any time without stopping the job.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result};
use parallel::comm::flight::{diagnose, now_ms, read_dir, Diagnosis, FlightRecorder, SLOTS};
use parallel::CommError;

use crate::recipe::Recipe;

/// Where a run's records go.
pub fn dir(recipe: &Recipe) -> PathBuf {
    recipe.run.dir.join("flight")
}

/// Rank `rank`'s recorder: in [`dir`] when the run writes outputs, else in memory. A rank
/// process keeps its last [`SLOTS`] operations (512 KiB); the thread ranks of one process keep
/// at most about 32 MiB together (64 operations each at the least). A record file another
/// process holds (a second run on the same `run.dir`, which rank 0's run lock refuses, or a
/// lock a dead node left on a network file system) is left alone: the rank records in memory
/// and says so.
pub fn recorder(
    recipe: &Recipe,
    rank: usize,
    write_outputs: bool,
    threads: bool,
) -> Result<Arc<FlightRecorder>> {
    let world = recipe.parallel.world_size();
    let slots = if threads {
        (65_536 / world.max(1)).clamp(64, SLOTS)
    } else {
        SLOTS
    };
    Ok(Arc::new(if write_outputs {
        let d = dir(recipe);
        match FlightRecorder::in_dir(&d, slots, rank, world) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {
                tracing::warn!("rank {rank}: {e}; its flight record is kept in memory");
                FlightRecorder::in_memory(slots, rank, world)
            }
            Err(e) => {
                return Err(anyhow::Error::from(e).context(format!(
                    "creating the flight record of rank {rank} in {}",
                    d.display()
                )))
            }
        }
    } else {
        FlightRecorder::in_memory(slots, rank, world)
    }))
}

/// The diagnosis of the records of ranks `0..world` in `dir` as they stand.
pub fn from_dir(dir: &Path, world: usize) -> Diagnosis {
    diagnose(&read_dir(dir, world), world, now_ms())
}

/// The diagnosis of in-process recorders.
pub fn from_recorders(recorders: &[Arc<FlightRecorder>], world: usize) -> Diagnosis {
    let records: Vec<_> = recorders.iter().map(|r| r.snapshot()).collect();
    diagnose(&records, world, now_ms())
}

/// Logs a diagnosis.
pub fn report(d: &Diagnosis) {
    tracing::error!("flight recorder:\n  {}", d.lines.join("\n  "));
}

/// Whether `e` ended a rank on a communication timeout (where a diagnosis says who is missing).
pub fn timed_out(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(CommError::find)
        .any(|c| matches!(c, CommError::Timeout { .. }))
}

fn usr1() -> &'static Arc<AtomicUsize> {
    static COUNT: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    COUNT.get_or_init(|| Arc::new(AtomicUsize::new(0)))
}

/// Counts SIGUSR1 from now on instead of dying of it (idempotent).
pub fn install_usr1() -> Result<()> {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    if INSTALLED.get().is_some() {
        return Ok(());
    }
    let count = usr1().clone();
    // SAFETY: the handler only increments an atomic, which is async-signal-safe.
    unsafe {
        signal_hook::low_level::register(signal_hook::consts::SIGUSR1, move || {
            count.fetch_add(1, Ordering::SeqCst);
        })
    }
    .context("installing the SIGUSR1 handler")?;
    let _ = INSTALLED.set(());
    Ok(())
}

/// SIGUSR1 received so far (see [`install_usr1`]).
pub fn usr1_count() -> usize {
    usr1().load(Ordering::SeqCst)
}

/// A thread logging `source()` at every SIGUSR1 until dropped.
pub struct Watch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Starts a [`Watch`] (installing the SIGUSR1 handler).
pub fn watch(source: impl Fn() -> Diagnosis + Send + 'static) -> Result<Watch> {
    install_usr1()?;
    let stop = Arc::new(AtomicBool::new(false));
    let quit = stop.clone();
    let mut seen = usr1_count();
    let thread = std::thread::Builder::new()
        .name("flight-watch".into())
        .spawn(move || {
            while !quit.load(Ordering::Relaxed) {
                let now = usr1_count();
                if now != seen {
                    seen = now;
                    report(&source());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
        .context("starting the SIGUSR1 watcher")?;
    Ok(Watch {
        stop,
        thread: Some(thread),
    })
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
