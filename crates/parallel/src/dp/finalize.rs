//! Completing every gradient of a step once this rank's backward pass has produced it (what
//! Megatron calls finalising the model's gradients), parameter by parameter as each becomes final:
//!
//! 1. partial sums of copies held by other ranks of the same data-parallel replica are added:
//!    the norm gains under sequence parallelism (each tensor-parallel rank saw only its share of
//!    the tokens) over the tensor-parallel group, and the tied embedding over the first and last
//!    pipeline stage (both hold a copy);
//! 2. the gradient goes to the data-parallel bucket reducer ([`GradSync`]), which all-reduces (or,
//!    with ZeRO-1, reduce-scatters) a bucket on its thread as soon as the bucket is complete,
//!    while the backward pass goes on.
//!
//! Tensor-parallel sums run at once, on the calling thread: every rank of a tensor-parallel group
//! runs the same schedule, so they all reach them at the same point. The tied embedding's sum
//! pairs the first stage with the last, which reach their copies' final backward at different
//! points of the schedule and may not wait for each other there (the last stage still has
//! gradients to send); it is deferred to [`GradFinalizer::finish`], after the schedule.

use std::sync::Arc;

use candle_core::{Result, Tensor};

use super::{BucketSpan, FlatLayout, GradSync};
use crate::comm::{Comm, Group, ReduceOp};

/// Which other ranks hold partial sums of a parameter's gradient (besides data-parallel replicas).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Partial {
    /// Summed over the tensor-parallel group (a replicated parameter under sequence parallelism).
    pub over_tp: bool,
    /// Summed over the first and last pipeline stage (the tied embedding with pipelining).
    pub over_pipeline_ends: bool,
}

/// The groups gradients are summed over.
#[derive(Debug, Clone)]
pub struct GradGroups {
    /// This rank's data-parallel group.
    pub dp: Group,
    /// Its tensor-parallel group.
    pub tp: Group,
    /// The first and last stage of its pipeline.
    pub pipeline_ends: Group,
}

/// Finalises one rank's gradients, held in the flat buffer `grads` laid out by `layout`.
pub struct GradFinalizer {
    comm: Arc<dyn Comm>,
    grads: Tensor,
    layout: FlatLayout,
    groups: GradGroups,
    partial: Vec<Partial>,
    /// Parameters whose pipeline-ends sum waits for the end of the schedule.
    deferred: Vec<usize>,
    /// The data-parallel bucket reducer (`None` with one data-parallel rank).
    sync: Option<GradSync>,
}

impl GradFinalizer {
    /// A finaliser for the gradients in `grads` (`[layout.total]` f32, shared with the caller),
    /// where parameter `i`'s other partial sums are described by `partial[i]`. With more than one
    /// data-parallel rank it starts the bucket reducer's thread (reduce-scatter with `zero1`).
    pub fn new(
        comm: Arc<dyn Comm>,
        grads: Tensor,
        layout: FlatLayout,
        groups: GradGroups,
        partial: Vec<Partial>,
        zero1: bool,
    ) -> Result<Self> {
        if partial.len() != layout.numels.len() {
            candle_core::bail!(
                "gradient finaliser: {} parameter descriptions for {} parameters",
                partial.len(),
                layout.numels.len()
            );
        }
        let sync = if groups.dp.size() > 1 {
            let dp = groups.dp.clone();
            Some(GradSync::new(
                layout.clone(),
                grads.clone(),
                comm.clone(),
                dp,
                zero1,
            )?)
        } else {
            None
        };
        Ok(Self {
            comm,
            grads,
            layout,
            groups,
            partial,
            deferred: Vec::new(),
            sync,
        })
    }

    /// Begins a step: every parameter is pending again.
    pub fn start(&mut self) {
        self.deferred.clear();
        if let Some(s) = &mut self.sync {
            s.start();
        }
    }

    /// Parameter `i`'s gradient is final on this rank (no backward of this step adds to it).
    pub fn param_final(&mut self, i: usize) -> Result<()> {
        if self.partial[i].over_pipeline_ends {
            self.deferred.push(i);
            return Ok(());
        }
        self.complete(i)
    }

    /// After the schedule: sums the deferred pipeline-ends copies, then waits until every
    /// data-parallel bucket has been reduced; returns when each bucket was (none with one
    /// data-parallel rank).
    pub fn finish(&mut self) -> Result<Vec<BucketSpan>> {
        for i in std::mem::take(&mut self.deferred) {
            self.sum_over(i, &self.groups.pipeline_ends.clone())?;
            self.complete(i)?;
        }
        match &mut self.sync {
            Some(s) => s.finish(),
            None => Ok(Vec::new()),
        }
    }

    /// Adds the tensor-parallel partial sums of `i` (if any) and hands it to the bucket reducer.
    fn complete(&mut self, i: usize) -> Result<()> {
        if self.partial[i].over_tp {
            self.sum_over(i, &self.groups.tp.clone())?;
        }
        match &mut self.sync {
            Some(s) => s.ready(i),
            None => Ok(()),
        }
    }

    /// Replaces parameter `i`'s gradient by its sum over `group`.
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
