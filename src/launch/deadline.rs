//! The exit deadline of a rank process. Once its job has failed — the first failure a backend
//! reports (`parallel::comm::failure`: a peer's abort, a lost connection, an NCCL error, this
//! rank's own abort) or this rank's own error — the process ends within the deadline whatever a
//! stuck thread does: a blocking NCCL call that an abort did not return, a peer that never
//! answers, a destructor waiting on either. torchrun and Slurm have no launcher of ours to kill a
//! hung rank, and a hung rank keeps its GPU and the job's allocation. The exit is `_exit`: no
//! destructor or `atexit` handler runs (either may be what hangs); the status says whether this
//! rank failed first (1) or followed another ([`super::PEER_FAILED_EXIT`]).

use std::io::Write;
use std::time::Duration;

/// The deadline of a job whose collectives time out after `timeout_s`: that long, at most a
/// minute.
pub fn for_timeout(timeout_s: f64) -> Duration {
    Duration::from_secs_f64(timeout_s.clamp(1.0, 60.0))
}

/// Arms the deadline for rank `rank` at the job's first failure (once per process; a second
/// call keeps the first).
pub fn install(rank: usize, deadline: Duration) {
    parallel::comm::failure::set_hook(Box::new(move |failed, reason| {
        let reason = reason.to_string();
        let timer = std::thread::Builder::new()
            .name("exit-deadline".into())
            .spawn(move || expire(rank, deadline, failed, &reason));
        if timer.is_err() {
            // No thread to wait with: end now rather than risk hanging.
            expire(rank, Duration::ZERO, failed, "");
        }
    }));
}

/// Waits `deadline`, then ends the process, saying why.
fn expire(rank: usize, deadline: Duration, failed: usize, reason: &str) {
    std::thread::sleep(deadline);
    let code = if failed == rank {
        1
    } else {
        i32::from(super::PEER_FAILED_EXIT)
    };
    let _ = writeln!(
        std::io::stderr(),
        "rank {rank}: still running {:.0} s after the job failed (rank {failed}: {reason}); \
         exiting with status {code}",
        deadline.as_secs_f64()
    );
    let _ = std::io::stderr().flush();
    let _ = std::io::stdout().flush();
    // SAFETY: `_exit` ends the process at once; nothing of this process runs after it.
    unsafe { libc::_exit(code) }
}
