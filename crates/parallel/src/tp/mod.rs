//! Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with optional sequence parallelism
//! (Korthikanti et al. 2022): the communication primitives, the TP plan, and the vocab-parallel
//! embedding and cross-entropy.
//!
//! A model always has a [`TensorParallel`]: without tensor parallelism it is a one-rank group,
//! whose region entries and exits are the identity and whose embedding and loss are the plain
//! single-rank ones, so model code has one path for every layout.

pub mod cross_entropy;
pub mod embedding;
pub mod ops;
pub mod plan;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{Result, Tensor};

use crate::comm::local::LocalWorld;
use crate::comm::Group;

pub use cross_entropy::vocab_parallel_cross_entropy;
pub use embedding::vocab_parallel_embedding;
pub use ops::TpGroup;
pub use plan::{tp_shard, Block, Shard, ShardError};

/// How one rank's layers are split: its tensor-parallel group and whether activations outside
/// the column/row-parallel regions are split along the sequence.
#[derive(Clone, Debug)]
pub struct TensorParallel {
    /// The tensor-parallel group.
    pub group: TpGroup,
    /// Sequence parallelism: norms and residuals hold `[b, s / tp, h]`.
    pub sequence_parallel: bool,
}

/// For ids of the whole vocabulary (`local_v × tp` entries) and this rank's slice starting at
/// `vocab_start`: the local row of each id (0 where another rank owns it) and a 1/0 ownership
/// mask. An id outside the vocabulary is an error (`what` names the caller and the kind of id,
/// e.g. "vocab-parallel embedding: token id"), never a silent zero.
pub(crate) fn local_vocab_ids(
    ids: &[u32],
    vocab_start: usize,
    local_v: usize,
    tp_size: usize,
    what: &str,
) -> Result<(Vec<u32>, Vec<f32>)> {
    let vocab = local_v * tp_size;
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        candle_core::bail!("{what} {bad} is outside the vocabulary of {vocab}");
    }
    Ok(ids
        .iter()
        .map(|&id| {
            let inside = (vocab_start..vocab_start + local_v).contains(&(id as usize));
            if inside {
                (id - vocab_start as u32, 1f32)
            } else {
                (0, 0.0)
            }
        })
        .unzip())
}

/// The dimension of `[b, s, h]` activations that sequence parallelism splits.
pub const SEQ_DIM: usize = 1;

impl TensorParallel {
    /// The tensor-parallel setup of a rank of `comm` in `group`.
    pub fn new(comm: Arc<dyn crate::Comm>, group: Group, sequence_parallel: bool) -> Self {
        Self {
            group: TpGroup { comm, group },
            sequence_parallel,
        }
    }

    /// No tensor parallelism, outside any job: a one-rank group on a one-rank communicator of its
    /// own (never called: every region op of a one-rank group is the identity).
    pub fn single() -> Self {
        let comm: Arc<dyn crate::Comm> = LocalWorld::new(1, Duration::from_secs(1)).remove(0);
        Self::new(comm, Group::new(vec![0]), false)
    }

    /// Degree of tensor parallelism.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's shard index.
    pub fn index(&self) -> usize {
        self.group.index()
    }

    /// Entry of a column-parallel region: the full `[b, s, h]` input every rank multiplies by its
    /// column shard (`gather_seq` from `[b, s/tp, h]` with sequence parallelism, else `copy_to_tp`).
    pub fn enter(&self, x: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            ops::gather_seq(x, &self.group, SEQ_DIM)
        } else {
            ops::copy_to_tp(x, &self.group)
        }
    }

    /// Token ids `[b, s]` → hidden states `[b, s, h]` (`[b, s / tp, h]` with sequence
    /// parallelism) from this rank's embedding rows `w` `[v / tp, h]`, which start at vocabulary
    /// id `vocab_start` (see [`vocab_parallel_embedding`]).
    pub fn embedding(&self, ids: &Tensor, w: &Tensor, vocab_start: usize) -> Result<Tensor> {
        vocab_parallel_embedding(ids, w, vocab_start, self)
    }

    /// Per-row losses `[n]` from this rank's logits `[n, v / tp]` (f32), which cover vocabulary
    /// ids from `vocab_start`, and the targets `[n]`: the vocab-parallel cross-entropy, or with one
    /// rank `single(logits, targets)` (a fused cross-entropy over the whole vocabulary).
    pub fn cross_entropy(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        vocab_start: usize,
        single: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        if self.size() == 1 {
            single(logits, targets)
        } else {
            vocab_parallel_cross_entropy(logits, targets, vocab_start, &self.group)
        }
    }

    /// Exit of a row-parallel region: sums the ranks' partial `[b, s, h]` results
    /// (`reduce_scatter_seq` to `[b, s/tp, h]` with sequence parallelism, else `reduce_from_tp`).
    pub fn exit(&self, y: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            ops::reduce_scatter_seq(y, &self.group, SEQ_DIM)
        } else {
            ops::reduce_from_tp(y, &self.group)
        }
    }
}
