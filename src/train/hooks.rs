//! `StepHooks`: where the parallelisms that act around a model piece meet the step executor.
//!
//! The executor (`pipeline.rs`) runs every rank's step, pipelined or not, and calls the hooks
//! around each piece (the embedding, a decoder block, the head) of each micro-batch:
//!
//! | hook | when | for |
//! |---|---|---|
//! | [`StepHooks::before_forward`] | before a piece's forward | gathering a sharded piece's parameters (ZeRO-3, not built yet) |
//! | [`StepHooks::before_backward`] | before a piece's backward (and its recompute) | the same, for the backward (ZeRO-3, not built yet) |
//! | [`StepHooks::after_backward`] | after a piece's gradients are accumulated | reducing gradients per micro-batch (ZeRO-2/3, not built yet) |
//! | [`StepHooks::param_final`] | after the last backward of the step that adds to a parameter | data-parallel sync ([`GradFinalizer`], today's user) |
//!
//! A parameter is final after the last micro-batch's backward of the last piece on this rank that
//! uses it; with interleaved pipelines a later chunk's parameters are final while earlier chunks
//! still run their cool-down, so their buckets are reduced during it.

use anyhow::Result;
use model::Piece;
use parallel::dp::GradFinalizer;

/// Callbacks of the step executor; every method defaults to doing nothing.
pub trait StepHooks {
    /// Before the forward of `piece` for micro-batch `micro`.
    fn before_forward(&mut self, piece: Piece, micro: usize) -> Result<()> {
        let _ = (piece, micro);
        Ok(())
    }

    /// Before the backward of `piece` for micro-batch `micro` (which re-runs its forward first
    /// under activation recompute).
    fn before_backward(&mut self, piece: Piece, micro: usize) -> Result<()> {
        let _ = (piece, micro);
        Ok(())
    }

    /// After the backward of `piece` for micro-batch `micro` has added its parameters' gradients
    /// into the gradient buffer.
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

/// Data-parallel gradient sync (with the tensor- and pipeline-parallel partial sums before it)
/// as each parameter becomes final.
impl StepHooks for GradFinalizer {
    fn param_final(&mut self, param: usize) -> Result<()> {
        Ok(GradFinalizer::param_final(self, param)?)
    }
}
