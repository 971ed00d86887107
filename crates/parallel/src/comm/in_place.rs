//! In-place collectives and hand-off marks.
//!
//! A rank's compute thread hands tensors to its communication thread (`thread.rs`), which
//! reduces or gathers them while the compute thread queues more work. On a device with a work
//! queue (CUDA), the collective must wait for the work that produced the tensor, and for nothing
//! later: waiting for everything queued when the communication thread gets to the job would hold
//! each reduction behind compute queued after it, and the overlap would be lost. A [`HandOff`],
//! taken by the producing thread when it hands the tensor over ([`Comm::hand_off`]), marks that
//! point.
//!
//! Only an operation in place can start from the mark: one that allocates its output, or copies
//! its input, does so on the device queue when it runs, and must then wait for that. So the
//! data-parallel reductions run in place on the buffers they reduce ([`Comm::all_reduce_in_place`],
//! [`Comm::reduce_scatter_in_place`], [`Comm::all_gather_in_place`]), which also spares a copy and
//! an output buffer per bucket. Backends without a device queue (`local`, `tcp`) need no mark and
//! compute in place through their ordinary collectives ([`through_copies`]).
//!
//! A mark covers the work its thread queued before taking it. A tensor last written by work the
//! communication thread itself queued (say, a shard that an earlier job summed into) is not
//! covered by the compute thread's mark: such a call passes [`HandOff::none`], and the operation
//! then waits for all device work queued when it is issued.

use std::any::Any;
use std::sync::Arc;

use candle_core::Tensor;

use crate::comm::Result;

use super::{Comm, CommError, Group, ReduceOp};

/// A mark in the device work a thread has queued (see the module documentation). Backends
/// define what it holds (NCCL: a CUDA event recorded on the device stream).
#[derive(Clone, Default)]
pub struct HandOff(Option<Arc<dyn Any + Send + Sync>>);

impl HandOff {
    /// No mark: an operation given it waits for all device work queued when it is issued.
    pub fn none() -> Self {
        Self(None)
    }

    /// A backend's mark.
    pub fn new(mark: impl Any + Send + Sync) -> Self {
        Self(Some(Arc::new(mark)))
    }

    /// The backend's mark, if this is one of type `T`.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.as_deref()?.downcast_ref()
    }
}

/// The in-place collectives computed with the ordinary ones and copied back: for backends whose
/// results are ready when a call returns (no device queue, so marks mean nothing).
pub mod through_copies {
    use super::*;

    /// [`Comm::all_reduce_in_place`]. A single member's `t` is its own reduction.
    pub fn all_reduce<C: Comm + ?Sized>(
        comm: &C,
        group: &Group,
        t: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        if group.size() == 1 && group.index_of(comm.rank()).is_some() {
            return Ok(());
        }
        let sum = comm.all_reduce(group, t, op)?;
        Ok(t.slice_set(&sum, 0, 0)?)
    }

    /// [`Comm::reduce_scatter_in_place`].
    pub fn reduce_scatter<C: Comm + ?Sized>(comm: &C, group: &Group, t: &Tensor) -> Result<Tensor> {
        let (me, chunk) = chunk_of(comm, "reduce_scatter", group, t)?;
        if group.size() > 1 {
            let part = comm.reduce_scatter(group, t, 0)?;
            t.slice_set(&part, 0, me * chunk)?;
        }
        Ok(t.narrow(0, me * chunk, chunk)?)
    }

    /// [`Comm::all_gather_in_place`].
    pub fn all_gather<C: Comm + ?Sized>(comm: &C, group: &Group, t: &Tensor) -> Result<()> {
        let (me, chunk) = chunk_of(comm, "all_gather", group, t)?;
        if group.size() == 1 {
            return Ok(());
        }
        let own = t.narrow(0, me * chunk, chunk)?;
        let all = comm.all_gather(group, &own, 0)?;
        Ok(t.slice_set(&all, 0, 0)?)
    }
}

/// This rank's member index in `group` and the length along dim 0 of each member's chunk of
/// `t`, for an in-place `op`; an error if `t` is not contiguous or not cut evenly.
pub fn chunk_of<C: Comm + ?Sized>(
    comm: &C,
    op: &'static str,
    group: &Group,
    t: &Tensor,
) -> Result<(usize, usize)> {
    let me = comm.rank();
    let invalid = |message: String| CommError::Invalid {
        me,
        op,
        group: group.ranks().to_vec(),
        message,
    };
    let Some(index) = group.index_of(me) else {
        return Err(invalid("this rank is not a member".into()));
    };
    let n = group.size();
    let rows = t.dims().first().copied().unwrap_or(0);
    if !t.is_contiguous() || t.rank() == 0 || !rows.is_multiple_of(n) {
        let msg = format!(
            "in place needs a contiguous tensor cut evenly along dim 0 into {n} chunks, not {:?}",
            t.shape()
        );
        return Err(invalid(msg));
    }
    Ok((index, rows / n))
}
