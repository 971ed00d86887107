//! The head (final norm, output projection, masked cross-entropy) with a hand-written backward
//! pass.
//!
//! The head's graph is where autograd's zero-filled gradients cost most: the logits' gradient
//! `[n, v/tp]` is filled and added into once more after the loss's backward wrote it (several
//! times over for the vocab-parallel loss, a composite of candle ops), and the output
//! projection's weight gradient `[v/tp, h]` likewise. Here the forward keeps a [`HeadTape`] and
//! the backward runs the loss's, the projection's and the norm's backward functions in turn, the
//! projection's weight gradient leaving as its factors for the fused accumulation (see
//! `backward.rs`). On one rank the loss is the fused cross-entropy (its backward kernel reads the
//! logits); under tensor parallelism the vocab-parallel loss keeps its exponentials instead
//! (`parallel::tp::vocab_parallel_cross_entropy_saved`). The values are autograd's, bit for bit:
//! the upstream gradient of each row's loss is `mask · loss_scale` as autograd forms it.

use candle_core::{DType, Result, Tensor};
use parallel::tp::{
    vocab_parallel_cross_entropy_bwd, vocab_parallel_cross_entropy_saved, VocabParallelSaved,
};

use super::backward::projection_bwd;
use super::{Llama, Targets};
use crate::ops::{self, linear};
use crate::segment::{storages, Held, ParamGrad};

/// What the loss's backward reads.
enum LossTape {
    /// One rank: the logits `[n, v]` (model dtype) and the per-row losses `[n]` in the
    /// accumulation dtype, as the fused cross-entropy returned them.
    Fused { logits: Tensor, losses: Tensor },
    /// Tensor parallelism: the vocab-parallel loss's exponentials and row sums.
    VocabParallel(VocabParallelSaved),
}

/// What the head's forward keeps for its backward pass.
pub struct HeadTape {
    /// The last block's output `[b, s(/tp), h]`.
    x: Tensor,
    /// Its norm as the projection reads it, as rows `[n, h]`.
    h: Tensor,
    /// The loss's saved tensors.
    loss: LossTape,
    /// Next-token ids `[n]` and the loss mask `[n]`, and the loss scale.
    targets: Targets,
}

impl HeadTape {
    /// The storages the tape keeps alive, its input and the targets included.
    pub fn held(&self) -> Held {
        let mut kept = vec![
            &self.x,
            &self.h,
            &self.targets.labels,
            &self.targets.loss_mask,
        ];
        match &self.loss {
            LossTape::Fused { logits, losses } => kept.extend([logits, losses]),
            LossTape::VocabParallel(saved) => kept.extend(saved.tensors()),
        }
        storages(&kept)
    }
}

impl Llama {
    /// Whether the head has a hand-written backward here: on every rank that holds it.
    pub(super) fn head_hand_written(&self) -> bool {
        self.placement.head
    }

    /// The head's forward without a graph: the micro-batch's scaled loss (the value of
    /// [`Llama::head_loss`]) and the tape [`Llama::head_backward`] needs.
    pub fn head_forward_saved(&self, x: &Tensor, targets: &Targets) -> Result<(Tensor, HeadTape)> {
        let (norm, head) = self.head_weights()?;
        let tp = &self.placement.tp;
        let x = x.detach();
        let h = tp.enter_value(&ops::rms_norm(&x, &norm, self.config.rms_norm_eps)?)?; // [b, s, h]
        let h = h.flatten_to(1)?; // [n, h]
        let logits = linear(&h, &head)?; // [n, v/tp]
        let (losses, loss) = if tp.size() == 1 {
            let losses = ops::cross_entropy_acc(&logits, &targets.labels)?; // [n]
            let tape = LossTape::Fused {
                logits,
                losses: losses.clone(),
            };
            (losses.to_dtype(DType::F32)?, tape)
        } else {
            let logits = logits.to_dtype(DType::F32)?;
            let vocab = self.params.get(self.head_params()?.1).block.range(0);
            let (losses, saved) = vocab_parallel_cross_entropy_saved(
                &logits,
                &targets.labels,
                vocab.start,
                &tp.group,
            )?;
            (losses, LossTape::VocabParallel(saved))
        };
        let value = ((losses * &targets.loss_mask)?.sum_all()? * targets.loss_scale)?;
        let tape = HeadTape {
            x,
            h,
            loss,
            targets: targets.clone(),
        };
        Ok((value, tape))
    }

    /// The head's backward pass from its tape (the loss is the objective itself): the input's
    /// gradient `[b, s(/tp), h]` and the final norm's and output projection's gradients.
    pub fn head_backward(&self, tape: HeadTape) -> Result<(Tensor, Vec<(usize, ParamGrad)>)> {
        let HeadTape {
            x,
            h,
            loss,
            targets,
        } = tape;
        let (norm, head) = self.head_weights()?;
        let (norm_i, head_i) = self.head_params()?;
        // d loss / d losses_i = mask_i · loss_scale, formed as autograd forms it.
        let dlosses = targets.loss_mask.affine(targets.loss_scale, 0.0)?;
        let dlogits = match &loss {
            LossTape::Fused { logits, losses } => {
                ops::cross_entropy_acc_bwd(logits, &targets.labels, losses, &dlosses)?
            }
            LossTape::VocabParallel(saved) => {
                vocab_parallel_cross_entropy_bwd(saved, &dlosses)?.to_dtype(h.dtype())?
            }
        }; // [n, v/tp]
        drop(loss);
        let (dh, d_head) = projection_bwd(&h, &head, &dlogits)?; // [n, h] partial
        let dh = dh.reshape((x.dim(0)?, (), h.dim(1)?))?; // [b, s, h] partial
        let dh = self.placement.tp.enter_grad(&dh)?; // [b, s(/tp), h]
        let (dx, d_norm) = ops::rms_norm_bwd(&x, &norm, self.config.rms_norm_eps, &dh)?;
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
            .ok_or_else(|| self.missing("head"))
    }

    /// The final norm's and output projection's weights, detached.
    fn head_weights(&self) -> Result<(Tensor, Tensor)> {
        let (norm, head) = self.head_params()?;
        Ok((self.w(norm)?.detach(), self.w(head)?.detach()))
    }
}
