//! `StepHooks`: where the parallelisms that act around a model piece meet the step executor.
//!
//! The executor (`pipeline.rs`) runs every rank's step, pipelined or not, and calls the hooks
//! around each piece (the embedding, a decoder block, the head) of each micro-batch:
//!
//! | hook | when | used by |
//! |---|---|---|
//! | [`StepHooks::before_forward`] | before a piece's forward | ZeRO-3: install its parameters |
//! | [`StepHooks::after_forward`] | after it | ZeRO-3: release them (unless the next use reads them) |
//! | [`StepHooks::before_backward`] | before its backward (and its recompute) | ZeRO-3: install |
//! | [`StepHooks::after_accumulate`] | after its gradients are added into the buffer | ZeRO-2/3: reduce-scatter them |
//! | [`StepHooks::after_backward`] | after its backward (and the accumulation, unless deferred) | ZeRO-3: release |
//! | [`StepHooks::param_final`] | after the last accumulation of the step that adds to a parameter | data-parallel sync |
//!
//! A parameter is final after the last micro-batch's accumulation of the last piece on this rank
//! that uses it; with interleaved pipelines a later chunk's parameters are final while earlier
//! chunks still run their cool-down, so their buckets are reduced during it. In a zero-bubble
//! schedule a block's accumulation is its weight action's, after the backward: the parameters
//! are released by then (the weight gradients need only the kept factors). [`StepSync`] is the
//! training step's implementation, over [`DataParallel`] and the ZeRO-3 [`Gatherer`].

use anyhow::Result;
use model::{Llama, Piece};
use parallel::dp::DataParallel;

use crate::optim::GradBuffer;
use parallel::dp::{Gatherer, Pass};

/// Callbacks of the step executor; every method defaults to doing nothing.
pub trait StepHooks {
    /// Before the forward of `piece` for micro-batch `micro`.
    fn before_forward(&mut self, piece: Piece, micro: usize) -> Result<()> {
        let _ = (piece, micro);
        Ok(())
    }

    /// After the forward of `piece` for micro-batch `micro`.
    fn after_forward(&mut self, piece: Piece, micro: usize) -> Result<()> {
        let _ = (piece, micro);
        Ok(())
    }

    /// Before the backward of `piece` for micro-batch `micro` (which re-runs its forward first
    /// under activation recompute).
    fn before_backward(&mut self, piece: Piece, micro: usize) -> Result<()> {
        let _ = (piece, micro);
        Ok(())
    }

    /// After `piece`'s gradients for micro-batch `micro` were added into the gradient buffer
    /// (in its backward, or in a split backward's weight action).
    fn after_accumulate(&mut self, piece: Piece, micro: usize) -> Result<()> {
        let _ = (piece, micro);
        Ok(())
    }

    /// After the backward of `piece` for micro-batch `micro` (and its accumulation, unless the
    /// schedule defers that to a weight action).
    fn after_backward(&mut self, piece: Piece, micro: usize) -> Result<()> {
        let _ = (piece, micro);
        Ok(())
    }

    /// Parameter `param`'s gradient is final for this step on this rank.
    fn param_final(&mut self, param: usize) -> Result<()> {
        let _ = param;
        Ok(())
    }
}

/// No hooks (a single rank outside a training job, e.g. gradient tests).
impl StepHooks for () {}

/// A training step's hooks: data-parallel gradient completion and, with ZeRO-3, parameter
/// gathering.
pub struct StepSync<'a> {
    /// This rank's part of the model.
    pub model: &'a Llama,
    /// Its gradients.
    pub grads: &'a GradBuffer,
    /// Its data parallelism.
    pub dp: &'a mut DataParallel,
    /// ZeRO-3's gatherer.
    pub gather: Option<&'a mut Gatherer<Piece>>,
}

impl StepHooks for StepSync<'_> {
    fn before_forward(&mut self, piece: Piece, micro: usize) -> Result<()> {
        match &mut self.gather {
            Some(g) => Ok(g.before(self.model.params(), self.dp, (piece, micro, Pass::Forward))?),
            None => Ok(()),
        }
    }

    fn after_forward(&mut self, piece: Piece, _micro: usize) -> Result<()> {
        match &mut self.gather {
            Some(g) => Ok(g.after(self.model.params(), piece)?),
            None => Ok(()),
        }
    }

    fn before_backward(&mut self, piece: Piece, micro: usize) -> Result<()> {
        match &mut self.gather {
            Some(g) => {
                Ok(g.before(self.model.params(), self.dp, (piece, micro, Pass::Backward))?)
            }
            None => Ok(()),
        }
    }

    fn after_accumulate(&mut self, _piece: Piece, _micro: usize) -> Result<()> {
        if self.grads.is_sharded() {
            for (b, full) in self.grads.take_staged() {
                self.dp.reduce_scatter(b, full)?;
            }
        }
        Ok(())
    }

    fn after_backward(&mut self, piece: Piece, _micro: usize) -> Result<()> {
        match &mut self.gather {
            Some(g) => Ok(g.after(self.model.params(), piece)?),
            None => Ok(()),
        }
    }

    fn param_final(&mut self, param: usize) -> Result<()> {
        Ok(self.dp.param_final(param)?)
    }
}
