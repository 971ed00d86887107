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
    /// Which parameters were reported final this step.
    reported: Vec<bool>,
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
            reported: vec![false; partial.len()],
            partial,
            deferred: Vec::new(),
            sync,
        })
    }

    /// Begins a step: every parameter is pending again.
    pub fn start(&mut self) {
        self.reported.fill(false);
        self.deferred.clear();
        if let Some(s) = &mut self.sync {
            s.start();
        }
    }

    /// Parameter `i`'s gradient is final on this rank (no backward of this step adds to it).
    pub fn param_final(&mut self, i: usize) -> Result<()> {
        match self.reported.get_mut(i) {
            None => candle_core::bail!("gradient finaliser: no parameter {i}"),
            Some(true) => candle_core::bail!("gradient finaliser: parameter {i} reported twice"),
            Some(seen) => *seen = true,
        }
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
        if let Some(i) = self.reported.iter().position(|&r| !r) {
            candle_core::bail!("gradient finaliser: parameter {i} was never reported final");
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

    /// Adds the tensor-parallel partial sums of `i` (if any) and hands it to the bucket reducer.
    fn complete(&mut self, i: usize) -> Result<()> {
        if self.partial[i].over_tp {
            self.sum_over(i, &self.groups.tp)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::local::LocalWorld;
    use candle_core::{DType, Device};

    #[test]
    fn every_parameter_is_reported_exactly_once() {
        let comm: Arc<dyn Comm> = LocalWorld::new(1, std::time::Duration::from_secs(5)).remove(0);
        let layout = FlatLayout::new(&[2, 3], 1 << 20, 1);
        let grads = Tensor::zeros(layout.total, DType::F32, &Device::Cpu).unwrap();
        let one = Group::new(vec![0]);
        let groups = GradGroups {
            dp: one.clone(),
            tp: one.clone(),
            pipeline_ends: one,
        };
        let partial = vec![Partial::default(); 2];
        let mut f = GradFinalizer::new(comm, grads, layout, groups, partial, false).unwrap();
        f.start();
        f.param_final(1).unwrap();
        let e = f.finish().unwrap_err().to_string();
        assert!(e.contains("parameter 0 was never reported final"), "{e}");
        f.start();
        f.param_final(0).unwrap();
        let e = f.param_final(0).unwrap_err().to_string();
        assert!(e.contains("parameter 0 reported twice"), "{e}");
        assert!(f.param_final(2).is_err(), "no parameter 2");
        f.start();
        f.param_final(0).unwrap();
        f.param_final(1).unwrap();
        assert_eq!(
            f.finish().unwrap(),
            vec![],
            "no data-parallel sync with one rank"
        );
    }
}
