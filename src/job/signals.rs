//! Graceful stops: SIGTERM and SIGINT (what Slurm, Kubernetes, torchrun and Ctrl-C send before
//! SIGKILL) are recorded, not acted on at once. The training loop asks [`pending`] at each step
//! boundary; the ranks agree on it, finish the step, save one checkpoint and exit with status
//! `128 + signal` ([`Interrupted`]). A second signal while stopping changes nothing; SIGKILL
//! still ends a process at once, and the atomic checkpoint protocol keeps the previous
//! checkpoint loadable.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{Context, Result};

/// The signals that stop a run gracefully.
pub const STOP_SIGNALS: [i32; 2] = [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT];

fn received() -> &'static Arc<AtomicUsize> {
    static RECEIVED: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    RECEIVED.get_or_init(|| Arc::new(AtomicUsize::new(0)))
}

/// Records SIGTERM and SIGINT from now on instead of dying of them (idempotent).
pub fn install() -> Result<()> {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    if INSTALLED.get().is_some() {
        return Ok(());
    }
    for sig in STOP_SIGNALS {
        signal_hook::flag::register_usize(sig, received().clone(), sig as usize)
            .with_context(|| format!("installing the handler of signal {sig}"))?;
    }
    let _ = INSTALLED.set(());
    Ok(())
}

/// The stop signal received, if any.
pub fn pending() -> Option<i32> {
    match received().load(Ordering::SeqCst) {
        0 => None,
        s => Some(s as i32),
    }
}

/// The name of a stop signal.
pub fn name(sig: i32) -> &'static str {
    match sig {
        signal_hook::consts::SIGTERM => "SIGTERM",
        signal_hook::consts::SIGINT => "SIGINT",
        _ => "a signal",
    }
}

/// A run that stopped on a signal after saving its state: the process exits with
/// [`Interrupted::exit_code`].
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "stopped by {}{}; {}",
    name(*.signal),
    match .step {
        Some(s) => format!(" after step {s}"),
        None => String::new(),
    },
    match (.note, .checkpoint) {
        (Some(note), _) => note.clone(),
        (None, Some(c)) => format!("saved {}; continue with checkpoint.resume=auto", c.display()),
        (None, None) => "every rank saved its state on the way out".to_string(),
    }
)]
pub struct Interrupted {
    /// The signal.
    pub signal: i32,
    /// The last step completed (unknown to a launcher).
    pub step: Option<usize>,
    /// The checkpoint saved on the way out (unknown to a launcher).
    pub checkpoint: Option<PathBuf>,
    /// What the stopped command left, when it is not a training run's state.
    pub note: Option<String>,
}

impl Interrupted {
    /// The conventional status of a process ended by `signal`: `128 + signal` (143 for SIGTERM,
    /// 130 for SIGINT).
    pub fn exit_code(&self) -> u8 {
        (128 + self.signal).clamp(0, 255) as u8
    }
}

/// Whether `e` is a graceful stop, and which.
pub fn interrupted(e: &anyhow::Error) -> Option<&Interrupted> {
    e.chain().find_map(|c| c.downcast_ref::<Interrupted>())
}
