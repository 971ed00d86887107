//! `StagedJobs`: the ZeRO-2/3 reductions a rank has handed to its communication thread, and the
//! bound on the staging buffers they hold.
//!
//! A reduce-scatter job holds its bucket's full-size f32 gradients (the staging buffer) until it
//! has run. When the network is slower than the backward pass, the jobs queue up and so do their
//! buffers: at worst a whole step's gradients at full size, which is what stage 2 exists to
//! avoid. With a bound of `n`, a rank about to hand over one more staged job first waits until
//! fewer than `n` staged jobs are queued or running (PyTorch FSDP bounds its all-gathers in
//! flight the same way), so at most `n` buffers are held besides the ones being accumulated.
//!
//! **When the bound is safe.** With one pipeline stage every rank runs the same sequence of
//! pieces, so the points where a rank can block — a collective of the compute thread (tensor,
//! context, expert parallelism), a wait for one of its own jobs (this bound, ZeRO-3's gathers) —
//! lie in one order shared by all ranks, and a rank blocked at a point waits only for others to
//! reach a point no later than its own (the collective's, or the one where the job was handed
//! over): a rank that has not yet reached that point is strictly behind the waiter. Following
//! the waits therefore leads ever further back, never in a circle. Pipeline stages run
//! different programs, and a stage waits for a later stage's activation gradients: a rank held
//! here before sending its own to the previous stage can close a circle through that stage's
//! wait for a job of another replica's. So the bound applies only to a rank whose pipeline has
//! one stage; with several the queue is unbounded (and `pretrain plan` says so).

use std::collections::VecDeque;
use std::sync::Arc;

use candle_core::Result;

use super::BucketSpan;
use crate::comm::thread::Ticket;
use crate::stats::StepStats;

/// Staged reductions a rank with one pipeline stage may have queued or running at once.
pub const STAGED_IN_FLIGHT: usize = 2;

/// One job handed to the communication thread.
struct Job {
    ticket: Ticket<Option<BucketSpan>>,
    /// Bytes of staging it holds until it has run (0 for a job on the persistent buffers).
    staged: usize,
}

/// A rank's data-parallel jobs in submission order (see the module docs).
pub struct StagedJobs {
    queue: VecDeque<Job>,
    /// At most this many staged jobs queued or running; `None`: unbounded.
    limit: Option<usize>,
    /// Spans of jobs already retired this step.
    done: Vec<BucketSpan>,
    /// Where the staging bytes held by queued or running jobs are reported.
    stats: Arc<StepStats>,
}

impl StagedJobs {
    /// Jobs with at most `limit` staged ones at once (`None`: unbounded), reporting the staging
    /// they hold to `stats`.
    pub fn new(limit: Option<usize>, stats: Arc<StepStats>) -> Self {
        Self {
            queue: VecDeque::new(),
            limit,
            done: Vec::new(),
            stats,
        }
    }

    /// Makes room for one more staged job: retires the jobs that have run and, under a bound,
    /// waits for the oldest ones until fewer than the bound hold staging. A job's failure is
    /// returned here (the step fails with it).
    pub fn make_room(&mut self) -> Result<()> {
        self.retire(false)?;
        let Some(limit) = self.limit else {
            return Ok(());
        };
        while self.queue.iter().filter(|j| j.staged > 0).count() >= limit.max(1) {
            self.retire(true)?;
        }
        Ok(())
    }

    /// Adds a job just handed over, holding `staged` bytes of staging until it has run.
    pub fn push(&mut self, ticket: Ticket<Option<BucketSpan>>, staged: usize) {
        self.queue.push_back(Job { ticket, staged });
        let held = self.queue.iter().map(|j| j.staged).sum();
        self.stats.reductions_staged(held);
    }

    /// Waits for every job and returns the spans of this step's reductions, the first failure
    /// if any job failed.
    pub fn finish(&mut self) -> Result<Vec<BucketSpan>> {
        let mut first_err = None;
        while !self.queue.is_empty() {
            if let Err(e) = self.retire(true) {
                first_err.get_or_insert(e);
            }
        }
        let done = std::mem::take(&mut self.done);
        match first_err {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// Retires the oldest job if it has run (or, with `wait`, once it has); with `wait` false,
    /// every leading job that has run. Jobs run in submission order.
    fn retire(&mut self, wait: bool) -> Result<()> {
        while let Some(front) = self.queue.front_mut() {
            if !wait && !front.ticket.is_done() {
                break;
            }
            if let Some(job) = self.queue.pop_front() {
                self.done.extend(job.ticket.wait()?);
            }
            if wait {
                break;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc::{channel, Receiver};
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::comm::thread::CommThread;

    /// The most staging bytes the jobs reported holding at once since the last call.
    fn peak(jobs: &StagedJobs) -> usize {
        jobs.stats.take().reductions_staged_peak
    }

    /// A job for bucket `b` that runs once `gate` lets it.
    fn gated(
        t: &CommThread,
        b: usize,
        gate: &Arc<Mutex<Receiver<()>>>,
    ) -> Ticket<Option<BucketSpan>> {
        let gate = gate.clone();
        t.submit(move || {
            gate.lock().unwrap().recv().unwrap();
            let now = Instant::now();
            Ok(Some(BucketSpan {
                bucket: b,
                start: now,
                end: now,
            }))
        })
        .unwrap()
    }

    /// With a bound of 2, a third staged job waits until the first has run; jobs on the
    /// persistent buffers (0 bytes) do not count; the peak never exceeds two buffers.
    #[test]
    fn a_bounded_queue_holds_at_most_its_bound_of_staged_buffers() {
        let t = CommThread::new("staging-test".into()).unwrap();
        let (open, gate) = channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let mut jobs = StagedJobs::new(Some(2), Arc::default());
        for b in 0..2 {
            jobs.make_room().unwrap(); // room: fewer than 2 staged
            jobs.push(gated(&t, b, &gate), 100);
        }
        jobs.push(t.submit(|| Ok(None)).unwrap(), 0);
        let opened = Arc::new(AtomicBool::new(false));
        let opener = {
            let opened = opened.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                opened.store(true, Ordering::SeqCst);
                for _ in 0..3 {
                    open.send(()).unwrap();
                }
            })
        };
        jobs.make_room().unwrap();
        assert!(
            opened.load(Ordering::SeqCst),
            "returned before a staged job ran"
        );
        jobs.push(gated(&t, 2, &gate), 100);
        assert_eq!(peak(&jobs), 200);
        let spans = jobs.finish().unwrap();
        assert_eq!(
            spans.iter().map(|s| s.bucket).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        opener.join().unwrap();
    }

    /// Unbounded (several pipeline stages) the queue never waits, and the peak is every staged
    /// buffer queued; jobs that have run are retired without waiting and leave the count.
    #[test]
    fn an_unbounded_queue_never_waits_and_retires_what_has_run() {
        let t = CommThread::new("staging-test".into()).unwrap();
        let (open, gate) = channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let mut jobs = StagedJobs::new(None, Arc::default());
        for b in 0..5 {
            jobs.make_room().unwrap();
            jobs.push(gated(&t, b, &gate), 10);
        }
        assert_eq!(peak(&jobs), 50);
        for _ in 0..5 {
            open.send(()).unwrap();
        }
        jobs.push(t.submit(|| Ok(None)).unwrap(), 0);
        let mut last = jobs.queue.len();
        while last > 0 {
            std::thread::sleep(Duration::from_millis(1));
            jobs.make_room().unwrap();
            last = jobs.queue.len();
        }
        peak(&jobs);
        jobs.push(gated(&t, 5, &gate), 10);
        assert_eq!(peak(&jobs), 10, "retired jobs hold nothing");
        open.send(()).unwrap();
        assert_eq!(jobs.finish().unwrap().len(), 6);
    }

    /// A job's failure comes back from the next wait, and `finish` reports it after waiting for
    /// the rest.
    #[test]
    fn a_failed_job_fails_the_step() {
        let t = CommThread::new("staging-test".into()).unwrap();
        let mut jobs = StagedJobs::new(Some(1), Arc::default());
        jobs.push(
            t.submit(|| -> Result<Option<BucketSpan>> { candle_core::bail!("link down") })
                .unwrap(),
            8,
        );
        let err = jobs.make_room().unwrap_err().to_string();
        assert!(err.contains("link down"), "{err}");
        jobs.push(
            t.submit(|| -> Result<Option<BucketSpan>> { candle_core::bail!("again") })
                .unwrap(),
            8,
        );
        jobs.push(t.submit(|| Ok(None)).unwrap(), 0);
        let err = jobs.finish().unwrap_err().to_string();
        assert!(err.contains("again"), "{err}");
        assert!(jobs.queue.is_empty());
    }
}
