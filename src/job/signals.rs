//! Graceful stops: SIGTERM and SIGINT (what Slurm, Kubernetes, torchrun and Ctrl-C send before
//! SIGKILL) are recorded, not acted on at once. The training loop asks [`pending`] at each step
//! boundary; the ranks agree on it, finish the step, save one checkpoint and exit with status
//! `128 + signal` ([`Interrupted`]).
//!
//! A step can be blocked where it cannot end (a hung file system, a log pipe nobody reads): a
//! second stop signal at least [`REPEAT_AFTER`] after the first ends the process at once, with
//! `128 + signal` and no checkpoint; the atomic checkpoint protocol keeps the previous one
//! loadable, as after SIGKILL. Signals closer together count as one: a scheduler that signals
//! every process of a job while our launcher forwards the same signal must not cost the
//! checkpoint. A launcher, told so ([`install_for_launcher`]), ends its ranks itself instead.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result};

/// The signals that stop a run gracefully.
pub const STOP_SIGNALS: [i32; 2] = [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT];

/// How long after the first stop signal a second one ends the process at once.
pub const REPEAT_AFTER: Duration = Duration::from_secs(5);

/// The first stop signal, when it came (monotonic milliseconds, never 0), whether a second
/// came [`REPEAT_AFTER`] or more later, and whether that one ends the process.
static RECEIVED: AtomicUsize = AtomicUsize::new(0);
static FIRST_MS: AtomicU64 = AtomicU64::new(0);
static REPEATED: AtomicUsize = AtomicUsize::new(0);
static EXIT_ON_REPEAT: AtomicBool = AtomicBool::new(true);

/// Milliseconds of the monotonic clock (`clock_gettime`, which a signal handler may call).
fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes the timespec it is given; it is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// The handler of a stop signal: only atomics, `clock_gettime`, `write` and `_exit`, which are
/// async-signal-safe.
fn on_signal(sig: i32) {
    let now = monotonic_ms().max(1);
    if FIRST_MS
        .compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok()
    {
        RECEIVED.store(sig as usize, Ordering::SeqCst);
        return;
    }
    let first = FIRST_MS.load(Ordering::SeqCst);
    if now.saturating_sub(first) < REPEAT_AFTER.as_millis() as u64 {
        return;
    }
    REPEATED.store(sig as usize, Ordering::SeqCst);
    if EXIT_ON_REPEAT.load(Ordering::SeqCst) {
        const MSG: &[u8] = b"a second stop signal: exiting at once, without a checkpoint (the \
            last one saved stays loadable)\n";
        // SAFETY: write(2) of a static buffer to stderr and _exit(2), both async-signal-safe.
        unsafe {
            libc::write(2, MSG.as_ptr().cast(), MSG.len());
            libc::_exit(128 + sig);
        }
    }
}

/// Records SIGTERM and SIGINT from now on instead of dying of them (idempotent); a second one
/// [`REPEAT_AFTER`] or more after the first ends the process at once.
pub fn install() -> Result<()> {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    if INSTALLED.get().is_some() {
        return Ok(());
    }
    for sig in STOP_SIGNALS {
        // SAFETY: `on_signal` does only async-signal-safe work.
        unsafe { signal_hook::low_level::register(sig, move || on_signal(sig)) }
            .with_context(|| format!("installing the handler of signal {sig}"))?;
    }
    let _ = INSTALLED.set(());
    Ok(())
}

/// [`install`] for a launcher: a repeated signal is only recorded ([`repeated`]), and the
/// launcher ends its rank processes itself.
pub fn install_for_launcher() -> Result<()> {
    EXIT_ON_REPEAT.store(false, Ordering::SeqCst);
    install()
}

/// The stop signal received, if any.
pub fn pending() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s as i32),
    }
}

/// A stop signal received [`REPEAT_AFTER`] or more after the first, if any (a launcher's).
pub fn repeated() -> Option<i32> {
    match REPEATED.load(Ordering::SeqCst) {
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
