//! One handle of an asynchronous communication library (an NCCL communicator in non-blocking
//! mode), shared by threads. The rules that keep it sound:
//!
//! - **One call at a time.** Every use of the handle (a call, a status poll, the abort) holds
//!   the guard's lock.
//! - **Settle before the next call.** A call the library answers "in progress" (NCCL's
//!   `ncclInProgress`: the work runs on the library's own thread) is polled, still under the
//!   lock, until the library reports it done or failed; only then may another call start (NCCL
//!   requires this of non-blocking communicators).
//! - **Abort from anywhere, last.** [`Guarded::abort`] first raises the `aborted` flag, then takes
//!   the lock. A settling call sees the flag at its next poll and returns [`Fault::Aborted`]
//!   without touching the handle again, so the abort waits at most one poll, never for the
//!   library; it runs exactly once, and nothing uses the handle after it.
//!
//! With a non-blocking library no call holds the lock for long, so an abort is never issued
//! under a call in progress (which a blocking communicator would need, and which races with
//! that call). A blocking handle would make an abort wait for the call in hand, which only the
//! process's exit deadline (`comm::failure`) bounds; the `nccl` backend refuses blocking
//! communicators.
//!
//! Generic over the handle so that these rules are tested without a GPU.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

/// Where a handle's last call stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Status {
    /// Done: the next call may start.
    Ready,
    /// Still running on the library's side.
    InProgress,
    /// The library reports a failure (its message).
    Failed(String),
}

/// The library side of a [`Guarded`] handle.
pub(crate) trait AsyncHandle {
    /// Where the last call stands (NCCL: `ncclCommGetAsyncError`). Also reports failures that
    /// arise later, e.g. a lost peer.
    fn status(&self) -> Status;
    /// Ends the handle: its pending work stops and its resources go (NCCL: `ncclCommAbort`).
    /// Called once, as the handle's last use.
    fn abort(&self);
}

/// Why a call on a [`Guarded`] handle did not go through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The handle was aborted (by this rank's failure handling).
    Aborted,
    /// The library refused the call or reported its failure; `usage` for invalid arguments or
    /// usage (a bug of the caller).
    Failed { usage: bool, message: String },
}

/// How a settling call polls: spinning (yielding) for [`SPIN`], then sleeping from [`NAP`],
/// doubling up to [`MAX_NAP`]. A launch that needs no connection settles within the spin.
const SPIN: Duration = Duration::from_millis(1);
const NAP: Duration = Duration::from_micros(20);
const MAX_NAP: Duration = Duration::from_millis(1);

/// A handle used under the rules of the module documentation.
pub(crate) struct Guarded<H: AsyncHandle> {
    handle: H,
    lock: Mutex<()>,
    aborted: AtomicBool,
    /// Calls the library answered "in progress" (then settled or failed).
    deferred: AtomicU64,
}

impl<H: AsyncHandle> Guarded<H> {
    /// Guards `handle`, whose creation the library may have `deferred` (answered "in
    /// progress": poll [`Guarded::ready`] before the first call).
    pub(crate) fn new(handle: H, deferred: bool) -> Self {
        Self {
            handle,
            lock: Mutex::new(()),
            aborted: AtomicBool::new(false),
            deferred: AtomicU64::new(deferred.into()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the handle, unless it has been aborted. `f` answers whether the library
    /// deferred the work (`Ok(true)`): the call then settles before returning (see the module
    /// documentation). Blocks while another thread's call settles.
    pub(crate) fn call(&self, f: impl FnOnce(&H) -> Result<bool, Fault>) -> Result<(), Fault> {
        let _guard = self.lock();
        if self.is_aborted() {
            return Err(Fault::Aborted);
        }
        if !f(&self.handle)? {
            return Ok(());
        }
        self.deferred.fetch_add(1, Ordering::Relaxed);
        self.settle()
    }

    /// Polls the handle (lock held) until its last call is done, failed, or the handle is being
    /// aborted.
    fn settle(&self) -> Result<(), Fault> {
        let start = Instant::now();
        let mut nap = NAP;
        loop {
            if self.is_aborted() {
                return Err(Fault::Aborted);
            }
            match self.handle.status() {
                Status::Ready => return Ok(()),
                Status::Failed(message) => {
                    let usage = false;
                    return Err(Fault::Failed { usage, message });
                }
                Status::InProgress if start.elapsed() < SPIN => std::thread::yield_now(),
                Status::InProgress => {
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(MAX_NAP);
                }
            }
        }
    }

    /// Whether the handle's last call (its creation, say) is done: `Ok(false)` while in
    /// progress. For a caller that polls with waits of its own; blocks only while another
    /// thread's call settles.
    pub(crate) fn ready(&self) -> Result<bool, Fault> {
        let _guard = self.lock();
        if self.is_aborted() {
            return Err(Fault::Aborted);
        }
        match self.handle.status() {
            Status::Ready => Ok(true),
            Status::InProgress => Ok(false),
            Status::Failed(message) => Err(Fault::Failed {
                usage: false,
                message,
            }),
        }
    }

    /// The failure the library reports for this handle (a failed peer or network), if any.
    /// Skips the check (`None`) while another thread's call holds the handle, and once aborted.
    pub(crate) fn failure(&self) -> Option<String> {
        let _guard = match self.lock.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        if self.is_aborted() {
            return None;
        }
        match self.handle.status() {
            Status::Failed(message) => Some(message),
            Status::Ready | Status::InProgress => None,
        }
    }

    /// Whether [`Guarded::abort`] has been called.
    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// How many calls the library answered "in progress".
    pub(crate) fn deferred(&self) -> u64 {
        self.deferred.load(Ordering::Relaxed)
    }

    /// Aborts the handle: its pending work ends and every later call fails with
    /// [`Fault::Aborted`]. Idempotent; callable from any thread; waits at most for the poll
    /// in hand of a settling call.
    pub(crate) fn abort(&self) {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        let _guard = self.lock();
        self.handle.abort();
    }
}

impl<H: AsyncHandle> Drop for Guarded<H> {
    /// Aborting (rather than destroying) never waits for peers.
    fn drop(&mut self) {
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    /// A handle that checks the rules: it panics when used by two threads at once or after
    /// its abort. Its status is whatever the test sets.
    #[derive(Default)]
    struct Fake {
        status: Mutex<Option<Status>>,
        inside: AtomicBool,
        freed: AtomicBool,
        polls: AtomicUsize,
        aborts: AtomicUsize,
    }

    impl Fake {
        fn set(&self, s: Status) {
            *self.status.lock().unwrap() = Some(s);
        }

        /// Marks one use of the handle; panics on an overlapping or late one.
        fn enter(&self) -> impl Drop + '_ {
            assert!(
                !self.freed.load(Ordering::SeqCst),
                "handle used after abort"
            );
            assert!(
                !self.inside.swap(true, Ordering::SeqCst),
                "two uses at once"
            );
            struct Exit<'a>(&'a AtomicBool);
            impl Drop for Exit<'_> {
                fn drop(&mut self) {
                    self.0.store(false, Ordering::SeqCst);
                }
            }
            Exit(&self.inside)
        }
    }

    impl AsyncHandle for Arc<Fake> {
        fn status(&self) -> Status {
            let _in = self.enter();
            self.polls.fetch_add(1, Ordering::SeqCst);
            // Long enough for a racing thread to overlap, were the lock missing.
            std::thread::sleep(Duration::from_micros(50));
            self.status.lock().unwrap().clone().unwrap_or(Status::Ready)
        }

        fn abort(&self) {
            let _in = self.enter();
            self.aborts.fetch_add(1, Ordering::SeqCst);
            self.freed.store(true, Ordering::SeqCst);
        }
    }

    fn guarded() -> (Arc<Fake>, Arc<Guarded<Arc<Fake>>>) {
        let fake = Arc::new(Fake::default());
        (fake.clone(), Arc::new(Guarded::new(fake, false)))
    }

    /// A call on another thread that the library keeps in progress (until the test says
    /// otherwise), 20 ms into its settling.
    fn call_in_progress(
        fake: &Fake,
        g: &Arc<Guarded<Arc<Fake>>>,
    ) -> std::thread::JoinHandle<Result<(), Fault>> {
        fake.set(Status::InProgress);
        let g = g.clone();
        let call = std::thread::spawn(move || g.call(|_| Ok(true)));
        std::thread::sleep(Duration::from_millis(20));
        call
    }

    #[test]
    fn a_call_done_at_once_is_not_polled() {
        let (fake, g) = guarded();
        assert_eq!(g.call(|_| Ok(false)), Ok(()));
        assert_eq!((fake.polls.load(Ordering::SeqCst), g.deferred()), (0, 0));
    }

    #[test]
    fn a_deferred_call_settles_before_the_next_starts() {
        let (fake, g) = guarded();
        fake.set(Status::InProgress);
        let flip = {
            let fake = fake.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                fake.set(Status::Ready);
            })
        };
        let t0 = Instant::now();
        assert_eq!(g.call(|_| Ok(true)), Ok(()));
        assert!(
            t0.elapsed() >= Duration::from_millis(30),
            "returned before it settled"
        );
        assert!(fake.polls.load(Ordering::SeqCst) > 1);
        assert_eq!(g.deferred(), 1);
        flip.join().unwrap();
        // A second thread's call waited for the first to settle: the fake would have panicked
        // on an overlap. Two calls racing, each deferred once.
        fake.set(Status::Ready);
        let other = {
            let g = g.clone();
            std::thread::spawn(move || g.call(|_| Ok(true)))
        };
        assert_eq!(g.call(|_| Ok(true)), Ok(()));
        assert_eq!(other.join().unwrap(), Ok(()));
        assert_eq!(g.deferred(), 3);
    }

    #[test]
    fn a_deferred_call_that_fails_reports_the_library_message() {
        let (fake, g) = guarded();
        fake.set(Status::Failed("remote error".into()));
        let usage = false;
        let message = "remote error".to_string();
        assert_eq!(g.call(|_| Ok(true)), Err(Fault::Failed { usage, message }));
        assert_eq!(g.failure().as_deref(), Some("remote error"));
        assert!(matches!(g.ready(), Err(Fault::Failed { .. })));
    }

    #[test]
    fn a_refused_call_keeps_its_fault() {
        let (_, g) = guarded();
        let refused = Fault::Failed {
            usage: true,
            message: "bad count".into(),
        };
        assert_eq!(g.call(|_| Err(refused.clone())), Err(refused));
        assert_eq!(g.deferred(), 0);
    }

    #[test]
    fn an_abort_ends_a_call_stuck_in_progress_and_is_the_last_use() {
        let (fake, g) = guarded();
        let stuck = call_in_progress(&fake, &g);
        // Were the abort to wait for the call to settle, this would end the wait (and the
        // checks below fail instead of hanging).
        let _rescue = {
            let fake = fake.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(2));
                fake.set(Status::Ready);
            })
        };
        let t0 = Instant::now();
        g.abort();
        // The abort waited for one poll at most, not for the call to finish.
        assert!(t0.elapsed() < Duration::from_millis(500));
        assert_eq!(stuck.join().unwrap(), Err(Fault::Aborted));
        g.abort();
        assert_eq!(fake.aborts.load(Ordering::SeqCst), 1);
        // Nothing touches the freed handle (the fake panics if anything does).
        assert_eq!(
            g.call(|_| panic!("called after abort")),
            Err(Fault::Aborted)
        );
        assert_eq!(g.ready(), Err(Fault::Aborted));
        assert_eq!(g.failure(), None);
    }

    #[test]
    fn the_failure_check_skips_a_busy_handle() {
        let (fake, g) = guarded();
        let busy = call_in_progress(&fake, &g);
        // The call holds the handle: the check does not wait for it (and cannot overlap it).
        let t0 = Instant::now();
        assert_eq!(g.failure(), None);
        assert!(t0.elapsed() < Duration::from_millis(100));
        fake.set(Status::Ready);
        assert_eq!(busy.join().unwrap(), Ok(()));
        assert_eq!(g.ready(), Ok(true));
    }

    #[test]
    fn a_deferred_creation_counts_and_is_polled_by_the_caller() {
        let fake = Arc::new(Fake::default());
        fake.set(Status::InProgress);
        let g = Guarded::new(fake.clone(), true);
        assert_eq!((g.ready(), g.deferred()), (Ok(false), 1));
        fake.set(Status::Ready);
        assert_eq!(g.ready(), Ok(true));
    }

    #[test]
    fn dropping_aborts_once() {
        let (fake, g) = guarded();
        drop(g);
        assert_eq!(fake.aborts.load(Ordering::SeqCst), 1);
    }
}
