//! The head (final norm, output projection, masked cross-entropy) with a hand-written backward
//! pass on a rank without tensor parallelism.
//!
//! The head's graph is where autograd's zero-filled gradients cost most: the logits' gradient
//! `[n, v]` is filled and added into once more after the cross-entropy's backward kernel wrote
//! it, and the output projection's weight gradient `[v, h]` likewise. Here the forward keeps a
//! [`HeadTape`] (the input, its norm, the logits and the per-row losses) and the backward runs
//! the loss's, the projection's and the norm's backward functions in turn, the projection's
//! weight gradient leaving as its factors for the fused accumulation (see `backward.rs`). The
//! values are autograd's, bit for bit: the upstream gradient of each row's loss is
//! `mask · loss_scale` as autograd forms it. Under tensor parallelism the vocab-parallel loss
//! keeps its autograd graph.

use candle_core::{DType, Result, Tensor};

use super::backward::projection_bwd;
use super::{Llama, Targets};
use crate::ops::{self, linear};
use crate::segment::{storages, Held, ParamGrad};

/// What the head's forward keeps for its backward pass.
pub struct HeadTape {
    /// The last block's output `[b, s, h]`.
    x: Tensor,
    /// Its norm as rows `[n, h]`.
    h: Tensor,
    /// The logits `[n, v]` (model dtype).
    logits: Tensor,
    /// Per-row losses `[n]` in the accumulation dtype (as the cross-entropy returned them).
    losses: Tensor,
    /// Next-token ids `[n]` and the loss mask `[n]`, and the loss scale.
    targets: Targets,
}

impl HeadTape {
    /// The storages the tape keeps alive, its input and the targets included.
    pub fn held(&self) -> Held {
        storages(&[
            &self.x,
            &self.h,
            &self.logits,
            &self.losses,
            &self.targets.labels,
            &self.targets.loss_mask,
        ])
    }
}

impl Llama {
    /// Whether the head has a hand-written backward here: it does on a rank that holds it
    /// without tensor parallelism.
    pub(super) fn head_hand_written(&self) -> bool {
        self.placement.head && self.placement.tp.size() == 1
    }

    /// The head's forward without a graph: the micro-batch's scaled loss (the value of
    /// [`Llama::head_loss`]) and the tape [`Llama::head_backward`] needs.
    pub fn head_forward_saved(&self, x: &Tensor, targets: &Targets) -> Result<(Tensor, HeadTape)> {
        let (norm, head) = self.head_weights()?;
        let x = x.detach();
        let h = ops::rms_norm(&x, &norm, self.config.rms_norm_eps)?.flatten_to(1)?; // [n, h]
        let logits = linear(&h, &head)?; // [n, v]
        let losses = ops::cross_entropy_acc(&logits, &targets.labels)?; // [n]
        let loss =
            ((losses.to_dtype(DType::F32)? * &targets.loss_mask)?.sum_all()? * targets.loss_scale)?;
        let tape = HeadTape {
            x,
            h,
            logits,
            losses,
            targets: targets.clone(),
        };
        Ok((loss, tape))
    }

    /// The head's backward pass from its tape (the loss is the objective itself): the input's
    /// gradient `[b, s, h]` and the final norm's and output projection's gradients.
    pub fn head_backward(&self, tape: HeadTape) -> Result<(Tensor, Vec<(usize, ParamGrad)>)> {
        let HeadTape {
            x,
            h,
            logits,
            losses,
            targets,
        } = tape;
        let (norm, head) = self.head_weights()?;
        let (norm_i, head_i) = self.head_params()?;
        // d loss / d losses_i = mask_i · loss_scale, formed as autograd forms it.
        let dlosses = targets.loss_mask.affine(targets.loss_scale, 0.0)?;
        let dlogits = ops::cross_entropy_acc_bwd(&logits, &targets.labels, &losses, &dlosses)?; // [n, v]
        let (dh, d_head) = projection_bwd(&h, &head, &dlogits)?; // [n, h]
        let (dx, d_norm) =
            ops::rms_norm_bwd(&x, &norm, self.config.rms_norm_eps, &dh.reshape(x.shape())?)?;
        Ok((
            dx,
            vec![(norm_i, ParamGrad::Tensor(d_norm)), (head_i, d_head)],
        ))
    }

    /// The final norm's and output projection's parameter indices.
    fn head_params(&self) -> Result<(usize, usize)> {
        let inv = &self.inventory;
        inv.norm
            .zip(inv.lm_head)
            .filter(|_| self.head_hand_written())
            .ok_or_else(|| self.missing("head without tensor parallelism"))
    }

    /// The final norm's and output projection's weights, detached.
    fn head_weights(&self) -> Result<(Tensor, Tensor)> {
        let (norm, head) = self.head_params()?;
        Ok((self.w(norm)?.detach(), self.w(head)?.detach()))
    }
}
