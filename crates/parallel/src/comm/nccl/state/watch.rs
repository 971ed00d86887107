//! The watchdog side of [`Shared`]: reaping pending operations (timeouts and NCCL's
//! asynchronous errors), the store's abort key, the watchdog loop, and the orderly exit.

use super::*;

impl Shared {
    /// Drops completed pending operations; reports the first one that failed, outlived the
    /// timeout or whose communicator reports an asynchronous error (once the job has failed,
    /// only drops completed ones). `all`: look at every pending operation (the watchdog);
    /// otherwise only at the oldest ones, up to the first still running (every call: the
    /// queue can be long while the host runs ahead of the GPU).
    pub(in crate::comm::nccl) fn reap_pending(&self, all: bool) -> Option<OpFault> {
        let failed = self.failure().is_some();
        let mut pending = lock(&self.pending);
        let fault = |p: &PendingOp, reason: String, timed_out: bool| OpFault {
            op: p.op,
            group: p.group.clone(),
            peers: p.peers.clone(),
            reason,
            timed_out,
        };
        // `Some(keep)`, or the operation's fault.
        let judge = |p: &PendingOp| -> Result<bool, OpFault> {
            match p.done.try_is_complete() {
                Ok(true) => Ok(false),
                Ok(false) if failed => Ok(true),
                Ok(false) if p.since.elapsed() >= self.timeout => {
                    let secs = self.timeout.as_secs_f64();
                    let done = if p.op == "send" {
                        "received"
                    } else {
                        "complete"
                    };
                    let reason = format!("{} not {done} within {secs:.1}s", p.what());
                    Err(fault(p, reason, true))
                }
                Ok(false) => match lock(&self.comms).get(&p.key).and_then(|c| c.async_error()) {
                    Some(e) => Err(fault(p, format!("NCCL error in {}: {e}", p.what()), false)),
                    None => Ok(true),
                },
                Err(_) if failed => Ok(false),
                Err(e) => Err(fault(p, format!("CUDA error in {}: {e}", p.what()), false)),
            }
        };
        if !all {
            while let Some(front) = pending.front() {
                match judge(front) {
                    Ok(false) => {
                        pending.pop_front();
                    }
                    Ok(true) => return None,
                    Err(f) => return Some(f),
                }
            }
            return None;
        }
        let mut first = None;
        pending.retain(|p| match judge(p) {
            Ok(keep) => keep,
            Err(f) => {
                let keep = f.timed_out;
                first.get_or_insert(f);
                keep
            }
        });
        first
    }

    /// Reads the job's failure record from the store: `(rank, reason)` once some rank aborted.
    pub(super) fn poll_store(&self) -> Option<(usize, String)> {
        let keys = AbortKeys::new(&self.prefix);
        let mut store = lock(&self.store);
        let read = |store: &mut Store| -> Result<Option<(usize, String)>, StoreError> {
            if store.add(&keys.count, 0)? == 0 {
                return Ok(None);
            }
            let rank = String::from_utf8_lossy(&store.get(&keys.rank)?)
                .parse()
                .unwrap_or(0);
            let reason = String::from_utf8_lossy(&store.get(&keys.reason)?).into_owned();
            Ok(Some((rank, reason)))
        };
        read(&mut store).unwrap_or_else(|e| Some((0, format!("rendezvous store unreachable: {e}"))))
    }

    /// Publishes this rank's failure unless another rank's was published first; returns the
    /// job's first failure (this one if the store cannot be reached).
    pub(in crate::comm::nccl) fn publish_abort(&self, reason: &str) -> (usize, String) {
        let keys = AbortKeys::new(&self.prefix);
        let mine = (self.rank, reason.to_string());
        let mut store = lock(&self.store);
        let publish = |store: &mut Store| -> Result<(usize, String), StoreError> {
            if store.add(&keys.claim, 1)? == 1 {
                store.set(&keys.rank, self.rank.to_string().as_bytes())?;
                store.set(&keys.reason, reason.as_bytes())?;
                store.add(&keys.count, 1)?;
                return Ok(mine.clone());
            }
            let rank = String::from_utf8_lossy(&store.get(&keys.rank)?).parse();
            let reason = String::from_utf8_lossy(&store.get(&keys.reason)?).into_owned();
            Ok(rank.map_or(mine.clone(), |rank| (rank, reason)))
        };
        publish(&mut store).unwrap_or(mine)
    }

    /// The watchdog: until stopped, every [`SLOW_CHECK`] drops completed pending operations, fails the job on
    /// a send or NCCL host call outliving the timeout, and polls the store for another rank's
    /// abort (every [`IDLE_POLL`] only, while this rank does not communicate).
    pub(in crate::comm::nccl) fn watch(&self) {
        let _ = self.stream.context().bind_to_thread();
        let mut polled = Instant::now();
        let active_poll = store_poll(self.world_size);
        loop {
            {
                let stop = lock(&self.stop);
                let (stop, _) = self
                    .stop_cv
                    .wait_timeout_while(stop, SLOW_CHECK, |s| !*s)
                    .unwrap_or_else(|e| e.into_inner());
                if *stop {
                    return;
                }
            }
            if let Some(f) = self.reap_pending(true) {
                self.fail(self.rank, f.reason);
            }
            if self.failure().is_some() {
                continue;
            }
            let stuck = lock(&self.host_calls)
                .values()
                .find(|(since, _)| since.elapsed() >= self.timeout)
                .map(|&(_, op)| op);
            if let Some(op) = stuck {
                let secs = self.timeout.as_secs_f64();
                self.fail(
                    self.rank,
                    format!("NCCL {op} call still in progress after {secs:.1}s"),
                );
                continue;
            }
            let busy = !lock(&self.pending).is_empty() || !lock(&self.host_calls).is_empty();
            let active = busy || self.idle() < ACTIVE_WINDOW;
            let since = polled.elapsed();
            if (active && since >= active_poll) || since >= IDLE_POLL {
                polled = Instant::now();
                if let Some((rank, reason)) = self.poll_store() {
                    self.fail(rank, reason);
                }
            }
        }
    }

    /// Waits (bounded by the store's timeout) until every rank of the job has called this.
    pub(in crate::comm::nccl) fn exit_barrier(&self) {
        let name = format!("{}/exit", self.prefix);
        let _ = lock(&self.store).barrier(&name, self.world_size);
    }

    /// Asks the watchdog to return.
    pub(in crate::comm::nccl) fn stop(&self) {
        *lock(&self.stop) = true;
        self.stop_cv.notify_all();
    }
}
