//! The head (final norm, output projection, masked cross-entropy) with its hand-written backward
//! pass.
//!
//! The forward keeps a [`HeadTape`] and the backward runs the loss's, the projection's and the
//! norm's backward functions in turn, the projection's weight gradient leaving as its factors for
//! the fused accumulation (see `block.rs`). On one tensor-parallel rank the loss is the fused
//! cross-entropy (its backward kernel reads the logits); on more the vocab-parallel loss keeps its
//! exponentials instead (`parallel::tp::TensorParallel::cross_entropy`). The upstream gradient of
//! each row's loss is `mask · loss_scale`.

use candle_core::{Result, Tensor};
use parallel::tp::LossSaved;

use super::project::projection_bwd;
use super::{Llama, Targets, LOSS};
use crate::ops::{self, linear};
use crate::segment::ParamGrad;

/// What the head's forward keeps for its backward pass.
pub struct HeadTape {
    /// The last block's output `[b, s(/tp), h]`.
    x: Tensor,
    /// Its norm as the projection reads it, as rows `[n, h]`.
    h: Tensor,
    /// The loss's saved tensors.
    loss: LossSaved,
    /// Next-token ids `[n]` and the loss mask `[n]`, and the loss scale.
    targets: Targets,
}

impl HeadTape {
    /// The bytes the tape keeps besides its input (model `c`, shapes `s`): the final norm's
    /// rows as the projection reads them, the micro-batch's labels (u32) and loss mask (f32), and
    /// for the loss on one rank the logits (model dtype) and the per-row losses (accumulation
    /// dtype), under tensor parallelism the vocab-parallel loss's f32 exponentials `[n, v/tp]`,
    /// row sums, local target columns (u32) and ownership mask (f32).
    pub fn bytes(c: &crate::LlamaConfig, s: &crate::segment::TapeShape) -> u64 {
        let (n, t, p, h) = (s.n, s.t, s.p, s.h);
        let v = c.vocab_size as u64;
        let shared = n * h * p + n * (4 + 4);
        if t == 1 {
            shared + n * v * p + n * s.acc()
        } else {
            shared + 4 * n * v / t + n * (4 + 4 + 4)
        }
    }

    /// The tensors the tape keeps, its input and the targets included.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut kept = vec![
            &self.x,
            &self.h,
            &self.targets.labels,
            &self.targets.loss_mask,
        ];
        kept.extend(self.loss.tensors());
        kept
    }
}

impl Llama {
    /// Final norm and this rank's output projection: `[b, s(/tp), h]` → the norm as rows
    /// `[n, h]` and the logits `[n, v/tp]` in the model dtype.
    pub(super) fn head_logits(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let (norm, head) = self.head_weights()?;
        let h = ops::rms_norm(x, &norm, self.config.rms_norm_eps)?; // [b, s(/tp), h]
        let h = self.placement.tp.enter(&h)?.flatten_to(1)?; // [n, h]
        let logits = linear(&h, &head)?; // [n, v/tp]
        Ok((h, logits))
    }

    /// Per-position next-token losses `[n]` (f32, identical on every tensor-parallel rank; the
    /// full logits are never gathered across ranks) from the last hidden states, with the norm's
    /// rows and the loss's saved tensors.
    pub(super) fn head_losses(
        &self,
        x: &Tensor,
        labels: &Tensor,
    ) -> Result<(Tensor, Tensor, LossSaved)> {
        let (h, logits) = self.head_logits(x)?;
        let vocab = self.params.get(self.head_params()?.1).block.range(0);
        let (losses, saved) =
            self.placement
                .tp
                .cross_entropy(&logits, labels, vocab.start, LOSS)?;
        Ok((losses, h, saved))
    }

    /// The head's training forward: the micro-batch's summed masked loss times
    /// `targets.loss_scale`, and the tape [`Llama::head_backward`] reads.
    pub(super) fn head(&self, x: &Tensor, targets: &Targets) -> Result<(Tensor, HeadTape)> {
        let (losses, h, loss) = self.head_losses(x, &targets.labels)?;
        let value = ((losses * &targets.loss_mask)?.sum_all()? * targets.loss_scale)?;
        let tape = HeadTape {
            x: x.clone(),
            h,
            loss,
            targets: targets.clone(),
        };
        Ok((value, tape))
    }

    /// The head's backward pass from its tape (the loss is the objective itself): the input's
    /// gradient `[b, s(/tp), h]` and the final norm's and output projection's gradients.
    pub(super) fn head_backward(
        &self,
        tape: HeadTape,
    ) -> Result<(Tensor, Vec<(usize, ParamGrad)>)> {
        let HeadTape {
            x,
            h,
            loss,
            targets,
        } = tape;
        let (norm, head) = self.head_weights()?;
        let (norm_i, head_i) = self.head_params()?;
        let tp = &self.placement.tp;
        // d loss / d losses_i = mask_i · loss_scale.
        let dlosses = targets.loss_mask.affine(targets.loss_scale, 0.0)?;
        let dlogits = tp.cross_entropy_bwd(&loss, &targets.labels, &dlosses, LOSS)?; // [n, v/tp]
        drop(loss);
        let (dh, d_head) = projection_bwd(&h, &head, &dlogits)?; // [n, h] partial
        let dh = dh.reshape((x.dim(0)?, (), h.dim(1)?))?; // [b, s, h] partial
        let dh = tp.enter_grad(&dh)?; // [b, s(/tp), h]
        let (dx, d_norm) = ops::rms_norm_bwd(&x, &norm, self.config.rms_norm_eps, &dh)?;
        Ok((
            dx,
            vec![(norm_i, ParamGrad::Tensor(d_norm)), (head_i, d_head)],
        ))
    }

    /// The final norm's and output projection's parameter indices, on the rank holding them.
    fn head_params(&self) -> Result<(usize, usize)> {
        let inv = &self.inventory;
        inv.norm
            .zip(inv.lm_head)
            .filter(|_| self.placement.head)
            .ok_or_else(|| self.missing("head"))
    }

    /// The final norm's and output projection's weights.
    fn head_weights(&self) -> Result<(Tensor, Tensor)> {
        let (norm, head) = self.head_params()?;
        Ok((self.w(norm)?, self.w(head)?))
    }
}
