//! Data-parallel gradient synchronisation overlapped with the backward pass.
//!
//! The trainer reports each parameter as soon as its gradient is final (during the last
//! micro-batch's backward of its chunk). When every parameter of a bucket is final, the bucket's
//! reduction goes to the rank's communication thread — an all-reduce over the data-parallel
//! group, or with ZeRO-1 a reduce-scatter over the shard group (each rank keeps the sum of its
//! shard), followed with hybrid sharding by an all-reduce of the shard over the replica group —
//! while the backward pass continues with earlier layers. `finish` waits for the outstanding
//! buckets and reports when each one was reduced. Gradients are summed, not averaged: the loss is
//! already normalised by the global batch's token count.
//!
//! Reductions run in place on the gradient buffer, ordered after the hand-off mark taken when the
//! bucket completes (`comm::in_place`): on a GPU each waits for the backward work that made its
//! gradients, not for the work queued by the time the communication thread reaches it, and no
//! bucket is copied or given an output buffer.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{Result, Tensor};

use super::FlatLayout;
use crate::comm::thread::{CommThread, Ticket};
use crate::comm::{Comm, Group, ReduceOp};

/// How a complete bucket is reduced across data-parallel ranks. Expert buckets (see
/// [`FlatLayout::grouped`]) use `expert_grad` in place of `grad` or `shard`.
#[derive(Debug, Clone)]
pub enum Reduction {
    /// All-reduce over the gradient group: every rank gets the whole sum.
    AllReduce {
        /// The gradient group.
        grad: Group,
        /// The expert gradient group.
        expert_grad: Group,
    },
    /// Reduce-scatter over the shard group, so each rank keeps the sum of its shard of the
    /// bucket; then, with hybrid sharding, an all-reduce of that shard over the replica group.
    Shard {
        /// The ranks sharing the state (ZeRO shard group).
        shard: Group,
        /// The ranks holding the same shard in other shard groups.
        replicate: Group,
        /// The expert gradient group, which shares the experts' state (expert buckets are not
        /// replicated).
        expert_grad: Group,
    },
}

/// When one bucket's reduction ran (on the communication thread).
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
    flat: Tensor,
    comm: Arc<dyn Comm>,
    reduction: Reduction,
    /// Parameters still pending per bucket in the current step.
    pending: Vec<usize>,
    in_flight: Vec<Ticket<BucketSpan>>,
    thread: CommThread,
}

impl GradSync {
    /// A reducer for gradients held in `flat` (`layout.total` f32 elements), with its own
    /// communication thread.
    pub fn new(
        layout: FlatLayout,
        flat: Tensor,
        comm: Arc<dyn Comm>,
        reduction: Reduction,
    ) -> Result<Self> {
        // A bucket's reduce-scatter leaves this rank's member index's chunk in place: its shard.
        if let Reduction::Shard {
            shard, expert_grad, ..
        } = &reduction
        {
            if let Some(g) = [shard, expert_grad]
                .into_iter()
                .find(|g| g.index_of(comm.rank()).is_none())
            {
                candle_core::bail!(
                    "gradient sync: rank {} is not in its shard group {g:?}",
                    comm.rank()
                );
            }
        }
        let thread = CommThread::new(format!("dp-sync-{}", comm.rank()))?;
        Ok(Self {
            pending: vec![0; layout.buckets.len()],
            layout,
            flat,
            comm,
            reduction,
            in_flight: Vec::new(),
            thread,
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
            let bucket = self.layout.buckets[b].clone();
            // [len]: the bucket's gradients, reduced where they lie, once the backward work
            // queued so far (which made them) is done, and not after later work.
            let data = self.flat.narrow(0, bucket.start, bucket.len)?;
            let after = self.comm.hand_off()?;
            let (comm, reduction) = (self.comm.clone(), self.reduction.clone());
            let ticket = self.thread.submit(move || {
                let start = Instant::now();
                match &reduction {
                    Reduction::AllReduce { grad, expert_grad } => {
                        let group = if bucket.expert { expert_grad } else { grad };
                        comm.all_reduce_in_place(group, &data, ReduceOp::Sum, &after)?;
                    }
                    Reduction::Shard {
                        shard,
                        replicate,
                        expert_grad,
                    } => {
                        let group = if bucket.expert { expert_grad } else { shard };
                        // This rank's shard (`Bucket::shard` of its member index), in place.
                        let part = comm.reduce_scatter_in_place(group, &data, &after)?; // [len / n]
                        if replicate.size() > 1 && !bucket.expert {
                            comm.all_reduce_in_place(replicate, &part, ReduceOp::Sum, &after)?;
                        }
                    }
                }
                Ok(BucketSpan {
                    bucket: b,
                    start,
                    end: Instant::now(),
                })
            })?;
            self.in_flight.push(ticket);
        }
        Ok(())
    }

    /// Waits until every bucket of the step has been reduced and returns when each was (in
    /// submission order); an error names the failure.
    pub fn finish(&mut self) -> Result<Vec<BucketSpan>> {
        if let Some((b, n)) = self.pending.iter().enumerate().find(|(_, &n)| n > 0) {
            candle_core::bail!(
                "gradient sync: bucket {b} still waits for {n} parameters at the end of backward"
            );
        }
        let (mut spans, mut first_err) = (Vec::with_capacity(self.in_flight.len()), None);
        for ticket in self.in_flight.drain(..) {
            match ticket.wait() {
                Ok(span) => spans.push(span),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(spans), Err)
    }
}
