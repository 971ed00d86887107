//! The loss over a vocabulary split across the tensor-parallel group: each rank holds logits for
//! its slice of the vocabulary; the loss is computed from three small all-reduces (row max, row
//! sum of exponentials, target logit) and the full `[n, v]` logits are never gathered. With one
//! rank it is the model's fused cross-entropy ([`LossKernels`]).

use candle_core::{DType, Result, Tensor, D};

use super::{TensorParallel, TpGroup};
use crate::comm::ReduceOp;

/// The model's fused single-rank cross-entropy (its op library provides it).
#[derive(Clone, Copy)]
pub struct LossKernels {
    /// Per-row losses `[n]` (accumulation dtype) from logits `[n, v]` and targets `[n]` (u32).
    pub fwd: fn(&Tensor, &Tensor) -> Result<Tensor>,
    /// The logits' gradient (their dtype) from `(logits, targets, losses, dlosses)`.
    pub bwd: fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<Tensor>,
}

/// What the loss's backward reads.
pub enum LossSaved {
    /// One rank: the logits `[n, v]` (model dtype) and the per-row losses `[n]` in the
    /// accumulation dtype, as the fused cross-entropy returned them.
    Fused {
        /// `[n, v]`.
        logits: Tensor,
        /// `[n]`.
        losses: Tensor,
    },
    /// More than one rank: the vocab-parallel loss's exponentials and row sums, and the
    /// logits' dtype.
    VocabParallel(VocabParallelSaved, DType),
}

impl LossSaved {
    /// The tensors kept.
    pub fn tensors(&self) -> Vec<&Tensor> {
        match self {
            LossSaved::Fused { logits, losses } => vec![logits, losses],
            LossSaved::VocabParallel(saved, _) => saved.tensors().to_vec(),
        }
    }
}

impl TensorParallel {
    /// Per-row losses `[n]` (f32) from this rank's logits `[n, v / tp]` (model dtype), which
    /// cover vocabulary ids from `vocab_start`, and the targets `[n]`; and what
    /// [`TensorParallel::cross_entropy_bwd`] reads. Every rank gets the same losses.
    pub fn cross_entropy(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        vocab_start: usize,
        kernels: LossKernels,
    ) -> Result<(Tensor, LossSaved)> {
        if self.size() == 1 {
            // Reads the model-dtype logits and sums in f32 (no f32 copy of the logits on a GPU).
            let losses = (kernels.fwd)(logits, targets)?; // [n]
            let value = losses.to_dtype(DType::F32)?;
            let logits = logits.clone();
            return Ok((value, LossSaved::Fused { logits, losses }));
        }
        let dtype = logits.dtype();
        let logits = logits.to_dtype(DType::F32)?;
        let (losses, saved) =
            vocab_parallel_cross_entropy(&logits, targets, vocab_start, &self.group)?;
        Ok((losses, LossSaved::VocabParallel(saved, dtype)))
    }

    /// The gradient of this rank's logits `[n, v / tp]` (their dtype) from the losses'
    /// upstream gradient `dlosses` `[n]`.
    pub fn cross_entropy_bwd(
        &self,
        saved: &LossSaved,
        targets: &Tensor,
        dlosses: &Tensor,
        kernels: LossKernels,
    ) -> Result<Tensor> {
        match saved {
            LossSaved::Fused { logits, losses } => (kernels.bwd)(logits, targets, losses, dlosses),
            LossSaved::VocabParallel(saved, dtype) => {
                vocab_parallel_cross_entropy_bwd(saved, dlosses)?.to_dtype(*dtype)
            }
        }
    }
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

/// Per-row losses `[n]` from this rank's logits `[n, v/tp]` (f32) covering vocabulary ids
/// `vocab_start..vocab_start + v/tp`, and the global `targets` `[n]` (u32), without a graph;
/// and what [`vocab_parallel_cross_entropy_bwd`] needs. Every rank gets the same losses.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    vocab_start: usize,
    tp: &TpGroup,
) -> Result<(Tensor, VocabParallelSaved)> {
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
/// `dlosses` `[n]`: `softmax − onehot` on the rank's slice times `dlosses`.
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
