//! How a process hears of its job's first failure: a backend that records one (a peer's abort,
//! a lost connection, an NCCL error, this rank's own abort) reports it here, and the hook the
//! process installed, if any, runs once. The binary's rank processes install the exit deadline
//! (`launch::deadline`): whatever a stuck thread does next, the process ends.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// What runs at the first failure: the rank that failed and why.
pub type Hook = Box<dyn Fn(usize, &str) + Send + Sync>;

static HOOK: OnceLock<Hook> = OnceLock::new();
static REPORTED: AtomicBool = AtomicBool::new(false);

/// Installs `hook` for this process; false when one was installed already (it stays).
pub fn set_hook(hook: Hook) -> bool {
    HOOK.set(hook).is_ok()
}

/// Reports a failure of rank `failed` (this process's own rank or a peer's): the hook runs for
/// the first report only.
pub fn report(failed: usize, reason: &str) {
    if let Some(hook) = HOOK.get() {
        if !REPORTED.swap(true, Ordering::SeqCst) {
            hook(failed, reason);
        }
    }
}
