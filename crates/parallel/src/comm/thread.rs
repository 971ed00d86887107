//! `CommThread`: a rank's communication thread. Work submitted to it runs one job at a time, in
//! submission order, while the submitting (compute) thread goes on; a [`Ticket`] waits for a job's
//! result.
//!
//! Collectives on one group must be issued in the same order by every member. A rank that issues
//! some collectives from its compute thread and others from this thread keeps that order by
//! giving each group to one thread only: data-parallel groups to this thread (gradient buckets,
//! ZeRO gathers and reduce-scatters), tensor- and pipeline-parallel groups to the compute thread.
//! Every member submits the same jobs in the same order (they run the same schedule), so the
//! jobs' collectives match across ranks.

use std::cell::Cell;
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::thread::JoinHandle;

use candle_core::{Error, Result};

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    /// Set on communication threads.
    static COMM_THREAD: Cell<bool> = const { Cell::new(false) };
    /// When the job running on this communication thread was submitted (milliseconds since the
    /// Unix epoch), for the flight recorder.
    static QUEUED_MS: Cell<Option<f64>> = const { Cell::new(None) };
}

/// When the job the calling communication thread runs was submitted (milliseconds since the
/// Unix epoch); `None` off communication threads.
pub fn queued_ms() -> Option<f64> {
    QUEUED_MS.with(Cell::get)
}

/// Whether the calling thread is a [`CommThread`]. Backends whose collectives can be ordered on
/// the GPU without the host waiting (NCCL) still wait on the host here: the results are picked
/// up by the compute thread later, and ordering the shared device stream behind them would stall
/// the compute queued after them.
pub fn on_comm_thread() -> bool {
    COMM_THREAD.with(Cell::get)
}

/// A rank's communication thread (see the module docs).
pub struct CommThread {
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

/// The pending result of a job submitted to a [`CommThread`].
#[must_use = "a ticket's result must be waited for"]
pub struct Ticket<T> {
    result: Receiver<Result<T>>,
    /// The result, once [`Ticket::is_done`] has seen it.
    ready: Option<Result<T>>,
}

impl<T> Ticket<T> {
    /// Waits for the job and returns its result.
    pub fn wait(self) -> Result<T> {
        match self.ready {
            Some(r) => r,
            None => self.result.recv().map_err(|_| stopped())?,
        }
    }

    /// Whether the job has run (or can no longer run), without waiting; the result is kept for
    /// [`Ticket::wait`].
    pub fn is_done(&mut self) -> bool {
        if self.ready.is_none() {
            match self.result.try_recv() {
                Ok(r) => self.ready = Some(r),
                Err(TryRecvError::Disconnected) => self.ready = Some(Err(stopped())),
                Err(TryRecvError::Empty) => {}
            }
        }
        self.ready.is_some()
    }
}

fn stopped() -> Error {
    Error::Msg("communication thread stopped before the job ran".into())
}

impl CommThread {
    /// Starts the thread, named `name`.
    pub fn new(name: String) -> Result<Self> {
        let (jobs, queue) = channel::<Job>();
        let worker = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                COMM_THREAD.with(|c| c.set(true));
                for job in queue {
                    job();
                }
            })
            .map_err(Error::wrap)?;
        Ok(Self {
            jobs: Some(jobs),
            worker: Some(worker),
        })
    }

    /// Runs `job` on the thread after every job submitted before it.
    pub fn submit<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<Ticket<T>> {
        let (done, result) = channel();
        let queued = super::flight::now_ms();
        let run: Job = Box::new(move || {
            QUEUED_MS.with(|q| q.set(Some(queued)));
            let out = job();
            QUEUED_MS.with(|q| q.set(None));
            // The submitter may have stopped waiting (its step failed): nothing to report to.
            let _ = done.send(out);
        });
        self.jobs
            .as_ref()
            .and_then(|q| q.send(run).ok())
            .ok_or_else(|| Error::Msg("communication thread stopped".into()))?;
        Ok(Ticket {
            result,
            ready: None,
        })
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn jobs_run_in_submission_order_and_report_their_results() {
        let t = CommThread::new("comm-test".into()).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let tickets: Vec<Ticket<usize>> = (0..20)
            .map(|k| {
                let seen = seen.clone();
                t.submit(move || {
                    seen.lock().unwrap().push(k);
                    Ok(k * k)
                })
                .unwrap()
            })
            .collect();
        let failing = t
            .submit(|| -> Result<()> { candle_core::bail!("boom") })
            .unwrap();
        let results: Vec<usize> = tickets.into_iter().map(|x| x.wait().unwrap()).collect();
        assert_eq!(results, (0..20).map(|k| k * k).collect::<Vec<_>>());
        assert_eq!(*seen.lock().unwrap(), (0..20).collect::<Vec<_>>());
        assert!(failing.wait().unwrap_err().to_string().contains("boom"));
    }

    #[test]
    fn a_ticket_tells_when_its_job_has_run_without_waiting() {
        let t = CommThread::new("comm-test".into()).unwrap();
        let (go, gate) = std::sync::mpsc::channel::<()>();
        let mut blocked = t
            .submit(move || {
                gate.recv().unwrap();
                Ok(7)
            })
            .unwrap();
        let mut after = t.submit(|| Ok(8)).unwrap();
        assert!(!blocked.is_done() && !after.is_done());
        go.send(()).unwrap();
        while !after.is_done() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(blocked.is_done(), "jobs run in order");
        assert_eq!((blocked.wait().unwrap(), after.wait().unwrap()), (7, 8));
    }

    #[test]
    fn jobs_know_they_run_on_the_communication_thread() {
        assert!(!on_comm_thread() && queued_ms().is_none());
        let t = CommThread::new("comm-test".into()).unwrap();
        let before = crate::comm::flight::now_ms();
        let queued = t
            .submit(|| Ok(queued_ms()))
            .unwrap()
            .wait()
            .unwrap()
            .unwrap();
        assert!(queued >= before && queued <= crate::comm::flight::now_ms());
        assert!(t.submit(|| Ok(on_comm_thread())).unwrap().wait().unwrap());
        assert!(!on_comm_thread());
    }
}
