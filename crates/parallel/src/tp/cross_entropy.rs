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

    let (local, mask) = super::local_vocab_ids(
        targets,
        vocab_start,
        local_v,
        tp.size(),
        "vocab-parallel cross-entropy: target",
    )?; // [n], [n]
    let local = local.reshape((n, 1))?;
    let mask = mask.to_dtype(z.dtype())?;
    let target_logit = reduce_from_tp(&(z.gather(&local, 1)?.squeeze(1)? * mask)?, tp)?; // [n]
    sum_exp.squeeze(1)?.log()? - target_logit
}
