//! Data-parallel gradient synchronisation overlapped with the backward pass.
//!
//! The trainer reports each parameter as soon as its gradient is final (during the last
//! micro-batch's backward of its chunk). When every parameter of a bucket is final, the bucket is
//! handed to a background thread that all-reduces it (or, with ZeRO-1, reduce-scatters it so each
//! rank keeps the sum of its shard) over the data-parallel group while the backward pass continues
//! with earlier layers. `finish` waits for the outstanding buckets and reports when each one was
//! reduced. Gradients are summed, not averaged: the loss is already normalised by the global
//! batch's token count.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use candle_core::{Result, Tensor};

use super::FlatLayout;
use crate::comm::{Comm, Group, ReduceOp};

/// When one bucket's reduction ran (on the reducer's thread).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketSpan {
    /// The bucket.
    pub bucket: usize,
    /// When the reduction started.
    pub start: Instant,
    /// When it ended.
    pub end: Instant,
}

/// Overlapped bucket reducer of one rank.
pub struct GradSync {
    layout: FlatLayout,
    /// Parameters still pending per bucket in the current step.
    pending: Vec<usize>,
    to_worker: Option<Sender<usize>>,
    from_worker: Receiver<Result<BucketSpan>>,
    in_flight: usize,
    worker: Option<JoinHandle<()>>,
}

impl GradSync {
    /// Starts the reducer thread for gradients held in `flat` (`layout.total` f32 elements).
    pub fn new(
        layout: FlatLayout,
        flat: Tensor,
        comm: Arc<dyn Comm>,
        dp: Group,
        zero1: bool,
    ) -> Result<Self> {
        let (to_worker, jobs) = channel::<usize>();
        let (done, from_worker) = channel::<Result<BucketSpan>>();
        let buckets = layout.buckets.clone();
        let me = dp
            .index_of(comm.rank())
            .expect("a rank belongs to its data-parallel group");
        let worker = std::thread::Builder::new()
            .name(format!("dp-sync-{}", comm.rank()))
            .spawn(move || {
                for b in jobs {
                    let bucket = &buckets[b];
                    let start = Instant::now();
                    let r = (|| {
                        let data = flat.narrow(0, bucket.start, bucket.len)?.copy()?; // [len]
                        if zero1 {
                            let shard = comm.reduce_scatter(&dp, &data, 0)?; // [len / dp]
                            flat.slice_set(&shard, 0, bucket.shard(me, dp.size()).start)?;
                        } else {
                            flat.slice_set(
                                &comm.all_reduce(&dp, &data, ReduceOp::Sum)?,
                                0,
                                bucket.start,
                            )?;
                        }
                        Ok(BucketSpan {
                            bucket: b,
                            start,
                            end: Instant::now(),
                        })
                    })();
                    if done.send(r).is_err() {
                        break;
                    }
                }
            })
            .map_err(candle_core::Error::wrap)?;
        let pending = vec![0; layout.buckets.len()];
        Ok(Self {
            layout,
            pending,
            to_worker: Some(to_worker),
            from_worker,
            in_flight: 0,
            worker: Some(worker),
        })
    }

    /// Begins a step's synchronisation: every parameter is pending again.
    pub fn start(&mut self) {
        for (p, b) in self.pending.iter_mut().zip(&self.layout.buckets) {
            *p = b.params.len();
        }
    }

    /// Parameter `i`'s gradient is final; launches its bucket's reduction once the bucket is complete.
    pub fn ready(&mut self, i: usize) -> Result<()> {
        let b = self.layout.bucket_of(i);
        if self.pending[b] == 0 {
            candle_core::bail!("gradient sync: parameter {i} reported twice in one step");
        }
        self.pending[b] -= 1;
        if self.pending[b] == 0 {
            let tx = self.to_worker.as_ref().expect("worker runs until drop");
            tx.send(b)
                .map_err(|_| candle_core::Error::Msg("gradient sync worker stopped".into()))?;
            self.in_flight += 1;
        }
        Ok(())
    }

    /// Waits until every bucket of the step has been reduced and returns when each was (in
    /// completion order); an error names the failure.
    pub fn finish(&mut self) -> Result<Vec<BucketSpan>> {
        if let Some((b, n)) = self.pending.iter().enumerate().find(|(_, &n)| n > 0) {
            candle_core::bail!(
                "gradient sync: bucket {b} still waits for {n} parameters at the end of backward"
            );
        }
        let (mut spans, mut first_err) = (Vec::with_capacity(self.in_flight), None);
        while self.in_flight > 0 {
            let r = self
                .from_worker
                .recv()
                .map_err(|_| candle_core::Error::Msg("gradient sync worker died".into()))?;
            self.in_flight -= 1;
            match r {
                Ok(span) => spans.push(span),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(spans), Err)
    }
}

impl Drop for GradSync {
    fn drop(&mut self) {
        self.to_worker.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
