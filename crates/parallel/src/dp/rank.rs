//! `DataParallel`: one rank's data-parallel machinery for a training step, driven by the step
//! executor's hooks — gradient finalisation at every ZeRO stage and, at stage 3, the gathering of
//! sharded parameters.
//!
//! **Completing a gradient.** Partial sums held by other ranks of the same data-parallel replica
//! are added: the norm gains under sequence parallelism (each tensor-parallel rank saw only its
//! share of the tokens) over the tensor-parallel group, and the tied embedding over the first and
//! last pipeline stage (both hold a copy). Then the replicas' gradients are summed:
//!
//! - stages 0 and 1: a parameter reported final goes to the bucket reducer ([`GradSync`]), which
//!   reduces a complete bucket on its thread while the backward pass goes on. Tensor-parallel sums
//!   run first, at once (every rank of a tensor-parallel group runs the same schedule, so they all
//!   reach them together); the tied embedding's pair of stages reach their copies' last backward
//!   at different points (the last stage still has gradients to send, so waiting there would
//!   deadlock): that sum is deferred to [`DataParallel::finish`].
//! - stages 2 and 3: gradients live only as this rank's shards (`grads`, `[n_owned]` in owned
//!   order). After every backward of a piece the executor hands over the full-size gradients of
//!   the buckets it touched ([`DataParallel::reduce_scatter`]); the communication thread
//!   reduce-scatters each over the shard group and adds this rank's part into its shard (with
//!   one pipeline stage at most [`STAGED_IN_FLIGHT`] such buckets wait or run: `staging.rs`).
//!   With hybrid sharding a bucket's shard is all-reduced over the replica group once all its
//!   parameters are final. The partial sums of other ranks of the replica are added to the
//!   shards at [`DataParallel::finish`], when every reduce-scatter is done.
//!
//! **Stage 3 parameters.** Each rank keeps its shards of the parameters (`[n_owned]` in the
//! training dtype, [`DataParallel::param_shards`]); [`DataParallel::gather`] all-gathers a
//! bucket on the communication thread and returns a ticket for the whole bucket.
//!
//! All data-parallel collectives of a step (shard and replica groups) run on one communication
//! thread in submission order; the compute thread issues only tensor- and pipeline-parallel ones.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Result, Tensor};

use super::stage::ZeroStage;
use super::staging::{StagedJobs, STAGED_IN_FLIGHT};
use super::{BucketSpan, FlatLayout, GradSync, Reduction};
use crate::comm::thread::{CommThread, Ticket};
use crate::comm::{Comm, Group, HandOff, ReduceOp};
use crate::mesh::RankGroups;
use crate::stats::StepStats;

/// Which other ranks hold partial sums of a parameter's gradient (besides data-parallel replicas).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Partial {
    /// Summed over the tensor-parallel group (a replicated parameter under sequence parallelism).
    pub over_tp: bool,
    /// Summed over the first and last pipeline stage (the tied embedding with pipelining).
    pub over_pipeline_ends: bool,
}

/// One rank's data parallelism (see the module docs).
pub struct DataParallel {
    comm: Arc<dyn Comm>,
    layout: FlatLayout,
    groups: RankGroups,
    zero: ZeroStage,
    partial: Vec<Partial>,
    /// This rank's gradients: the whole flat buffer (stages 0, 1) or its shards (stages 2, 3).
    grads: Tensor,
    /// The flat ranges whose state this rank owns, and where each starts in the owned order.
    owned: Vec<Range<usize>>,
    owned_at: Vec<usize>,
    /// Which parameters were reported final this step.
    reported: Vec<bool>,
    /// Parameters whose pipeline-ends sum waits for the end of the schedule (stages 0, 1).
    deferred: Vec<usize>,
    /// The bucket reducer (stages 0, 1 with more than one data-parallel rank).
    sync: Option<GradSync>,
    /// The communication thread (stages 2, 3).
    thread: Option<CommThread>,
    /// Stages 2, 3: parameters still to be reported final per bucket, and the jobs in flight.
    pending: Vec<usize>,
    jobs: StagedJobs,
    /// Stage 3: this rank's parameter shards in the training dtype (owned order).
    param_shards: Option<Tensor>,
}

impl DataParallel {
    /// The data parallelism of a rank with `groups` at ZeRO stage `zero` whose gradients are
    /// `grads` (shared
    /// with the caller: `[layout.total]` f32 at stages 0 and 1, `[n_owned]` f32 at 2 and 3), owning
    /// the flat ranges `owned`, where parameter `i`'s other partial sums are `partial[i]`. At stage
    /// 3 `param_shards` are the rank's initial shards of the parameters (`[n_owned]`, the owned
    /// ranges one after the other, in the parameters' dtype). At stages 2 and 3 the staging that
    /// reduce-scatters queued or running hold (at most [`STAGED_IN_FLIGHT`] buckets with one
    /// pipeline stage) is reported to `stats`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        (comm, stats): (Arc<dyn Comm>, Arc<StepStats>),
        layout: FlatLayout,
        groups: RankGroups,
        zero: ZeroStage,
        partial: Vec<Partial>,
        grads: Tensor,
        owned: Vec<Range<usize>>,
        param_shards: Option<Tensor>,
    ) -> Result<Self> {
        if partial.len() != layout.numels.len() {
            candle_core::bail!(
                "data parallelism: {} parameter descriptions for {} parameters",
                partial.len(),
                layout.numels.len()
            );
        }
        let expert_buckets = layout.buckets.iter().any(|b| b.expert);
        if expert_buckets && zero.shards_optimizer() && groups.replicate.size() > 1 {
            candle_core::bail!(
                "data parallelism: expert buckets (expert parallelism) are sharded without hybrid \
                 sharding only ({} replica groups)",
                groups.replicate.size()
            );
        }
        let mut owned_at = Vec::with_capacity(owned.len());
        let mut at = 0;
        for r in &owned {
            owned_at.push(at);
            at += r.len();
        }
        let (sync, thread) = match zero {
            ZeroStage::Off | ZeroStage::Optimizer if groups.grad.size() > 1 => {
                let reduction = if zero == ZeroStage::Off {
                    Reduction::AllReduce {
                        grad: groups.grad.clone(),
                        expert_grad: groups.expert_grad.clone(),
                    }
                } else {
                    Reduction::Shard {
                        shard: groups.shard.clone(),
                        replicate: groups.replicate.clone(),
                        expert_grad: groups.expert_grad.clone(),
                    }
                };
                let s = GradSync::new(layout.clone(), grads.clone(), comm.clone(), reduction)?;
                (Some(s), None)
            }
            ZeroStage::Off | ZeroStage::Optimizer => (None, None),
            ZeroStage::Gradients | ZeroStage::Parameters => {
                (None, Some(CommThread::new(format!("dp-{}", comm.rank()))?))
            }
        };
        let param_shards = match (zero.shards_parameters(), param_shards) {
            (true, Some(shards)) => Some(shards),
            (true, None) => candle_core::bail!("ZeRO-3 needs the initial parameter shards"),
            (false, _) => None,
        };
        // The bound on staged reductions is safe with one pipeline stage only (`staging.rs`).
        let one_stage = groups.pp.size() == 1;
        Ok(Self {
            comm,
            reported: vec![false; partial.len()],
            pending: vec![0; layout.buckets.len()],
            layout,
            groups,
            zero,
            partial,
            grads,
            owned,
            owned_at,
            deferred: Vec::new(),
            sync,
            thread,
            jobs: StagedJobs::new(one_stage.then_some(STAGED_IN_FLIGHT), stats),
            param_shards,
        })
    }

    /// The ZeRO stage.
    pub fn zero(&self) -> ZeroStage {
        self.zero
    }

    /// The flat layout of this rank's parameters.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// Begins a step: every parameter is pending again.
    pub fn start(&mut self) {
        self.reported.fill(false);
        self.deferred.clear();
        for (p, b) in self.pending.iter_mut().zip(&self.layout.buckets) {
            *p = b.params.len();
        }
        if let Some(s) = &mut self.sync {
            s.start();
        }
    }

    /// Stages 2 and 3: `full` (`[bucket len]` f32, padding zero) holds gradients added to
    /// bucket `b` by one piece's backward; it is reduce-scattered over the shard group on the
    /// communication thread and this rank's part is added into its shard of the bucket.
    pub fn reduce_scatter(&mut self, b: usize, full: Tensor) -> Result<()> {
        let staged = full.elem_count() * full.dtype().size_in_bytes();
        self.jobs.make_room()?;
        let (thread, shard) = (self.thread()?, self.shard_of(b)?);
        let (comm, group, grads) = (
            self.comm.clone(),
            self.shard_group(b).clone(),
            self.grads.clone(),
        );
        // `full` was made by the backward work queued so far: the reduction waits for that only.
        let after = self.comm.hand_off()?;
        let ticket = thread.submit(move || {
            let start = Instant::now();
            let part = comm.reduce_scatter_in_place(&group, &full, &after)?; // [len / n]
            let sum = (grads.narrow(0, shard.start, shard.len())? + part)?;
            grads.slice_set(&sum, 0, shard.start)?;
            Ok(Some(BucketSpan {
                bucket: b,
                start,
                end: Instant::now(),
            }))
        })?;
        self.jobs.push(ticket, staged);
        Ok(())
    }

    /// Parameter `i`'s gradient is final on this rank (no backward of this step adds to it).
    pub fn param_final(&mut self, i: usize) -> Result<()> {
        match self.reported.get_mut(i) {
            None => candle_core::bail!("data parallelism: no parameter {i}"),
            Some(true) => candle_core::bail!("data parallelism: parameter {i} reported twice"),
            Some(seen) => *seen = true,
        }
        if self.zero.shards_gradients() {
            let b = self.layout.bucket_of(i);
            self.pending[b] -= 1;
            if self.pending[b] == 0 && self.groups.replicate.size() > 1 {
                self.all_reduce_replicas(b)?;
            }
            return Ok(());
        }
        if self.partial[i].over_pipeline_ends {
            self.deferred.push(i);
            return Ok(());
        }
        self.complete(i)
    }

    /// After the schedule: completes what waits for it and waits until every data-parallel
    /// reduction is done; returns when each bucket was reduced (none with one data-parallel rank
    /// at stages 0 and 1).
    pub fn finish(&mut self) -> Result<Vec<BucketSpan>> {
        if let Some(i) = self.reported.iter().position(|&r| !r) {
            candle_core::bail!("data parallelism: parameter {i} was never reported final");
        }
        if self.zero.shards_gradients() {
            let spans = self.jobs.finish()?;
            // The other ranks' partial sums, on this rank's shards of those parameters.
            for (want, group) in [
                (true, self.groups.pipeline_ends.clone()),
                (false, self.groups.tp.clone()),
            ] {
                let params: Vec<usize> = (0..self.partial.len())
                    .filter(|&i| {
                        let p = self.partial[i];
                        if want {
                            p.over_pipeline_ends
                        } else {
                            p.over_tp
                        }
                    })
                    .collect();
                self.sum_owned(&params, &group)?;
            }
            return Ok(spans);
        }
        for i in std::mem::take(&mut self.deferred) {
            self.sum_over(i, &self.groups.pipeline_ends)?;
            self.complete(i)?;
        }
        match &mut self.sync {
            Some(s) => s.finish(),
            None => Ok(Vec::new()),
        }
    }

    /// Stage 3: this rank's parameter shards (`[n_owned]`, training dtype, owned order).
    pub fn param_shards(&self) -> Option<&Tensor> {
        self.param_shards.as_ref()
    }

    /// Stage 3: replaces the parameter shards with `owned` (`[n_owned]` in the training dtype,
    /// e.g. the optimizer's updated master weights, cast by the caller, which can cast a shard of
    /// any size).
    pub fn set_param_shards(&mut self, owned: &Tensor) -> Result<()> {
        let Some(shards) = &mut self.param_shards else {
            candle_core::bail!("data parallelism: parameter shards exist only at ZeRO stage 3");
        };
        if (owned.dtype(), owned.elem_count()) != (shards.dtype(), shards.elem_count()) {
            candle_core::bail!(
                "data parallelism: new parameter shards of {} {:?} elements for {} {:?} ones",
                owned.elem_count(),
                owned.dtype(),
                shards.elem_count(),
                shards.dtype()
            );
        }
        *shards = owned.clone();
        Ok(())
    }

    /// Stage 3: all-gathers bucket `b`'s parameters over the shard group on the communication
    /// thread; the ticket gives the whole bucket `[len]` in the training dtype and the seconds the
    /// all-gather took.
    pub fn gather(&self, b: usize) -> Result<Ticket<(Tensor, f64)>> {
        let Some(shards) = &self.param_shards else {
            candle_core::bail!("data parallelism: parameters are gathered only at ZeRO stage 3");
        };
        let shard = self.shard_of(b)?;
        let mine = shards.narrow(0, shard.start, shard.len())?;
        let (comm, group) = (self.comm.clone(), self.shard_group(b).clone());
        // The whole bucket, this rank's shard in its place, gathered in place once that copy
        // (and nothing queued after it) is done.
        let len = self.layout.buckets[b].len;
        let full = Tensor::zeros(len, mine.dtype(), mine.device())?; // [len]
        let at = group.index_of(comm.rank()).unwrap_or(0) * shard.len();
        full.slice_set(&mine, 0, at)?;
        let after = comm.hand_off()?;
        self.thread()?.submit(move || {
            let start = Instant::now();
            comm.all_gather_in_place(&group, &full, &after)?;
            Ok((full, start.elapsed().as_secs_f64()))
        })
    }

    fn thread(&self) -> Result<&CommThread> {
        self.thread.as_ref().ok_or_else(|| {
            candle_core::Error::Msg(
                "data parallelism: no communication thread below stage 2".into(),
            )
        })
    }

    /// Where this rank's shard of bucket `b` sits in the owned order.
    fn shard_of(&self, b: usize) -> Result<Range<usize>> {
        let bucket = &self.layout.buckets[b];
        let group = self.shard_group(b);
        let mine = bucket.shard(group.index_of(self.comm.rank()).unwrap_or(0), group.size());
        let k = self.owned.iter().position(|r| *r == mine).ok_or_else(|| {
            candle_core::Error::Msg(format!("data parallelism: bucket {b} has no shard here"))
        })?;
        Ok(self.owned_at[k]..self.owned_at[k] + mine.len())
    }

    /// The group bucket `b` is sharded over: the shard group, or for an expert bucket the
    /// expert gradient group.
    fn shard_group(&self, b: usize) -> &Group {
        if self.layout.buckets[b].expert {
            &self.groups.expert_grad
        } else {
            &self.groups.shard
        }
    }

    /// Hybrid sharding: sums bucket `b`'s shard over the replica group (after its reduce-scatters).
    fn all_reduce_replicas(&mut self, b: usize) -> Result<()> {
        let shard = self.shard_of(b)?;
        let (comm, group, grads) = (
            self.comm.clone(),
            self.groups.replicate.clone(),
            self.grads.clone(),
        );
        let ticket = self.thread()?.submit(move || {
            // The shard was last written by this thread's reduce-scatters (on the device queue,
            // after any mark the compute thread took): no mark, so the all-reduce waits for all
            // the device work queued when it is issued.
            let part = grads.narrow(0, shard.start, shard.len())?;
            comm.all_reduce_in_place(&group, &part, ReduceOp::Sum, &HandOff::none())?;
            Ok(None)
        })?;
        self.jobs.push(ticket, 0);
        Ok(())
    }

    /// Stages 2, 3: replaces this rank's shards of `params` with their sum over `group` (one
    /// all-reduce of all of them together).
    fn sum_owned(&self, params: &[usize], group: &Group) -> Result<()> {
        if group.size() == 1 || params.is_empty() {
            return Ok(());
        }
        let mut pieces = Vec::new(); // (owned-order start, len)
        for &i in params {
            let r = self.layout.range(i);
            for (k, o) in self.owned.iter().enumerate() {
                let cut = super::intersect(&r, o);
                if !cut.is_empty() {
                    pieces.push((self.owned_at[k] + cut.start - o.start, cut.len()));
                }
            }
        }
        // The members lay these parameters out alike (tensor-parallel ranks hold equal-sized
        // blocks; both pipeline ends keep the embedding alone in its bucket), so they own the same
        // elements and skip or call this all-reduce together.
        if pieces.is_empty() {
            return Ok(());
        }
        let parts = pieces
            .iter()
            .map(|&(at, n)| self.grads.narrow(0, at, n))
            .collect::<Result<Vec<_>>>()?;
        let sum = self
            .comm
            .all_reduce(group, &Tensor::cat(&parts, 0)?, ReduceOp::Sum)?;
        let mut off = 0;
        for (at, n) in pieces {
            self.grads.slice_set(&sum.narrow(0, off, n)?, 0, at)?;
            off += n;
        }
        Ok(())
    }

    /// Stages 0, 1: adds the tensor-parallel partial sums of `i` (if any) and hands it to the
    /// bucket reducer.
    fn complete(&mut self, i: usize) -> Result<()> {
        if self.partial[i].over_tp {
            self.sum_over(i, &self.groups.tp)?;
        }
        match &mut self.sync {
            Some(s) => s.ready(i),
            None => Ok(()),
        }
    }

    /// Stages 0, 1: replaces parameter `i`'s gradient by its sum over `group`.
    fn sum_over(&self, i: usize, group: &Group) -> Result<()> {
        if group.size() == 1 {
            return Ok(());
        }
        let r = self.layout.range(i);
        let g = self.grads.narrow(0, r.start, r.len())?; // [numel]
        let sum = self.comm.all_reduce(group, &g, ReduceOp::Sum)?;
        self.grads.slice_set(&sum, 0, r.start)
    }
}

/// The owned ranges of a whole flat buffer, back to back.
pub fn gather_owned(flat: &Tensor, owned: &[Range<usize>]) -> Result<Tensor> {
    let parts = owned
        .iter()
        .map(|r| flat.narrow(0, r.start, r.len()))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)
}
