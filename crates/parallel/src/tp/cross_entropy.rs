//! Vocab-parallel cross-entropy: each rank holds logits for its slice of the vocabulary; the loss
//! is computed from three small all-reduces (row max, row sum of exponentials, target logit) and
//! the full `[n, v]` logits are never gathered.

use candle_core::{Result, Tensor, D};

use super::ops::{reduce_from_tp, TpGroup};
use crate::comm::ReduceOp;

/// Per-row losses `[n]` from this rank's logits `[n, v/tp]` (f32) covering vocabulary ids
/// `vocab_start..vocab_start + v/tp`, and the global `targets` `[n]` (u32). Every rank gets the
/// same losses; gradients reach each rank's own logits (`softmax − onehot` on its slice).
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    vocab_start: usize,
    tp: &TpGroup,
) -> Result<Tensor> {
    let (n, local_v) = logits.dims2()?;
    let row_max = logits.detach().max_keepdim(D::Minus1)?; // [n, 1]
    let row_max = tp.comm.all_reduce(&tp.group, &row_max, ReduceOp::Max)?;
    let z = logits.broadcast_sub(&row_max)?; // [n, v/tp]
    let sum_exp = reduce_from_tp(&z.exp()?.sum_keepdim(D::Minus1)?, tp)?; // [n, 1]

    let (local, mask) = target_columns(targets, vocab_start, (n, local_v), z.dtype(), tp)?;
    let target_logit = reduce_from_tp(&(z.gather(&local, 1)?.squeeze(1)? * mask)?, tp)?; // [n]
    sum_exp.squeeze(1)?.log()? - target_logit
}

/// Each target's column in this rank's slice of `n` rows × `local_v` ids from `vocab_start`
/// (`[n, 1]` u32, 0 where another rank holds it) and whether this rank holds it (`[n]`, in the
/// logits' dtype `dtype`).
fn target_columns(
    targets: &Tensor,
    vocab_start: usize,
    (n, local_v): (usize, usize),
    dtype: candle_core::DType,
    tp: &TpGroup,
) -> Result<(Tensor, Tensor)> {
    let (local, mask) = super::local_vocab_ids(
        targets,
        vocab_start,
        local_v,
        tp.size(),
        "vocab-parallel cross-entropy: target",
    )?; // [n], [n]
    Ok((local.reshape((n, 1))?, mask.to_dtype(dtype)?))
}

/// What [`vocab_parallel_cross_entropy_bwd`] needs from the forward pass.
pub struct VocabParallelSaved {
    /// `exp(logits − row max)` of this rank's slice `[n, v/tp]`.
    exp: Tensor,
    /// The group's sum of those per row `[n]`.
    sum_exp: Tensor,
    /// Each target's column in this rank's slice `[n, 1]` (0 where another rank holds it).
    local: Tensor,
    /// 1 where this rank holds the target, else 0 `[n]`.
    mask: Tensor,
}

impl VocabParallelSaved {
    /// The tensors kept.
    pub fn tensors(&self) -> [&Tensor; 4] {
        [&self.exp, &self.sum_exp, &self.local, &self.mask]
    }
}

/// [`vocab_parallel_cross_entropy`] without a graph, for a hand-written backward: the same
/// losses (the same operations and collectives) and what [`vocab_parallel_cross_entropy_bwd`]
/// needs.
pub fn vocab_parallel_cross_entropy_saved(
    logits: &Tensor,
    targets: &Tensor,
    vocab_start: usize,
    tp: &TpGroup,
) -> Result<(Tensor, VocabParallelSaved)> {
    let logits = logits.detach();
    let (n, local_v) = logits.dims2()?;
    let row_max = logits.max_keepdim(D::Minus1)?; // [n, 1]
    let row_max = tp.comm.all_reduce(&tp.group, &row_max, ReduceOp::Max)?;
    let z = logits.broadcast_sub(&row_max)?; // [n, v/tp]
    let exp = z.exp()?;
    let sum_exp = tp
        .comm
        .all_reduce(&tp.group, &exp.sum_keepdim(D::Minus1)?, ReduceOp::Sum)?
        .squeeze(1)?; // [n]
    let (local, mask) = target_columns(targets, vocab_start, (n, local_v), z.dtype(), tp)?;
    let target_logit = (z.gather(&local, 1)?.squeeze(1)? * &mask)?;
    let target_logit = tp
        .comm
        .all_reduce(&tp.group, &target_logit, ReduceOp::Sum)?; // [n]
    let losses = (sum_exp.log()? - target_logit)?;
    let saved = VocabParallelSaved {
        exp,
        sum_exp,
        local,
        mask,
    };
    Ok((losses, saved))
}

/// The gradient of this rank's logits `[n, v/tp]` (f32) for the losses' upstream gradient
/// `dlosses` `[n]`: `softmax − onehot` on the rank's slice times `dlosses`, formed as autograd
/// forms it from [`vocab_parallel_cross_entropy`]'s graph (the same values, bit for bit).
pub fn vocab_parallel_cross_entropy_bwd(
    saved: &VocabParallelSaved,
    dlosses: &Tensor,
) -> Result<Tensor> {
    let VocabParallelSaved {
        exp,
        sum_exp,
        local,
        mask,
    } = saved;
    let dlosses = dlosses.to_dtype(exp.dtype())?;
    // log(sum_exp) − target: the sum's rows get dl / sum_exp, spread over the slice through exp.
    let row = (&dlosses / sum_exp)?.unsqueeze(1)?; // [n, 1]
    let dz = row.broadcast_as(exp.shape())?.mul(exp)?; // [n, v/tp]
                                                       // The target logit's −dl, where this rank holds the target.
    let target = (dlosses.neg()? * mask)?.unsqueeze(1)?; // [n, 1]
    dz.scatter_add(local, &target, 1)
}
