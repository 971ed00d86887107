//! Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with optional sequence parallelism
//! (Korthikanti et al. 2022): the region entries and exits with their gradients, the TP plan,
//! and the vocab-parallel embedding and cross-entropy.
//!
//! Megatron's four primitives are here as pairs of graph-free functions, a value and its
//! gradient, for the model's hand-written passes:
//!
//! | region | forward ([`TensorParallel::enter`], [`TensorParallel::exit`]) | backward (`_grad`) |
//! |---|---|---|
//! | column-parallel entry (f / SP gather) | identity, or all-gather along the sequence | all-reduce, or reduce-scatter |
//! | row-parallel exit (g / SP scatter) | all-reduce, or reduce-scatter along the sequence | identity, or all-gather |
//!
//! A model always has a [`TensorParallel`]: without tensor parallelism it is a one-rank group,
//! whose entries and exits are the identity and whose embedding and loss are the plain
//! single-rank ones, so model code has one path for every layout.

pub mod cross_entropy;
pub mod embedding;
pub mod plan;
pub mod register;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Result, Tensor};

use crate::comm::local::LocalWorld;
use crate::comm::{Comm, Group, ReduceOp};

pub use cross_entropy::{
    vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_bwd, LossKernels, LossSaved,
    VocabParallelSaved,
};
pub use embedding::{EmbeddingKernels, EmbeddingSaved};
pub use plan::{tp_shard, Block, Shard, ShardError};

/// The tensor-parallel group of one rank.
#[derive(Clone)]
pub struct TpGroup {
    /// The job's communicator.
    pub comm: Arc<dyn Comm>,
    /// Ranks sharing this rank's layers.
    pub group: Group,
}

impl TpGroup {
    /// Tensor-parallel degree.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's index within the group (its shard number).
    pub fn index(&self) -> usize {
        self.group
            .index_of(self.comm.rank())
            .expect("a rank belongs to its own tensor-parallel group")
    }
}

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TpGroup(rank {} of {:?})", self.comm.rank(), self.group)
    }
}

/// How one rank's layers are split: its tensor-parallel group and whether activations outside
/// the column/row-parallel regions are split along the sequence.
#[derive(Clone, Debug)]
pub struct TensorParallel {
    /// The tensor-parallel group.
    pub group: TpGroup,
    /// Sequence parallelism: norms and residuals hold `[b, s / tp, h]`.
    pub sequence_parallel: bool,
}

/// For ids `[n]` of the whole vocabulary (`local_v × tp` entries) and this rank's slice starting
/// at `vocab_start`: the local row of each id `[n]` u32 (0 where another rank owns it) and a 1/0
/// ownership mask `[n]` f32, computed on the ids' device without reading them back (a host
/// read per micro-batch would stall a GPU's queue). An id outside the vocabulary is never a
/// silent zero: on the CPU it is an error (`what` names the caller and the kind of id, e.g.
/// "vocab-parallel embedding: token id"); on a GPU its mask is NaN, so the loss becomes
/// non-finite and the step guard stops or skips the step (the data loader has already checked
/// every id against the tokenizer's vocabulary when it opened the data).
pub(crate) fn local_vocab_ids(
    ids: &Tensor,
    vocab_start: usize,
    local_v: usize,
    tp_size: usize,
    what: &str,
) -> Result<(Tensor, Tensor)> {
    let vocab = local_v * tp_size;
    let ids = ids.flatten_all()?;
    if ids.device().is_cpu() {
        let host = ids.to_dtype(DType::U32)?.to_vec1::<u32>()?;
        if let Some(bad) = host.iter().find(|&&id| id as usize >= vocab) {
            candle_core::bail!("{what} {bad} is outside the vocabulary of {vocab}");
        }
    }
    let x = ids.to_dtype(DType::I64)?; // [n]
    let (start, end) = (vocab_start as i64, (vocab_start + local_v) as i64);
    let owned = x.ge(start)?.mul(&x.lt(end)?)?.to_dtype(DType::F32)?; // [n] 1/0
    let outside = x.ge(vocab as i64)?; // [n]
    let nan = Tensor::full(f32::NAN, owned.shape(), owned.device())?;
    let mask = outside.where_cond(&nan, &owned)?;
    let local = x
        .broadcast_sub(&Tensor::new(start, x.device())?)?
        .clamp(0i64, local_v.saturating_sub(1) as i64)?
        .to_dtype(DType::U32)?;
    Ok((local, mask))
}

/// Sequence parallelism splits the tokens of a micro-batch `[b, s, h]` as one flat list of
/// `b · s` rows: rank `i` holds rows `[i, i + 1) · b · s / tp`, seen as `[b, s / tp, h]`. The ops
/// between regions (norms, residuals, routers) are per token, so which tokens a rank holds does
/// not matter to them, and every collective of the split is one flat buffer in member order: no
/// layout copy around it, whatever the micro-batch (Megatron gets the same from its `[s, b, h]`
/// layout). Splitting each sequence instead would make the all-gather of `[b, s/tp, h]` along
/// `s` a permute and a copy on every backend for `b > 1`.
fn token_rows(x: &Tensor) -> Result<Tensor> {
    let h = x.dim(x.rank() - 1)?;
    x.reshape((x.elem_count() / h.max(1), h))
}

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
    /// column shard, all-gathered from the ranks' `[b, s/tp, h]` token shares ([`token_rows`])
    /// with sequence parallelism, else `x` itself.
    pub fn enter(&self, x: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel && self.size() > 1 {
            let g = &self.group;
            let (b, s, h) = x.dims3()?;
            let rows = g.comm.all_gather(&g.group, &token_rows(x)?, 0)?; // [b·s·tp, h]
            rows.reshape((b, s * self.size(), h))
        } else {
            Ok(x.clone())
        }
    }

    /// The gradient of [`TensorParallel::enter`]'s input from its output's `dy` `[b, s, h]`: the
    /// reduce-scatter of the ranks' partial gradients with sequence parallelism, their all-reduce
    /// without, `dy` itself on one rank.
    pub fn enter_grad(&self, dy: &Tensor) -> Result<Tensor> {
        let g = &self.group;
        match (self.size(), self.sequence_parallel) {
            (1, _) => Ok(dy.clone()),
            (tp, true) => {
                let (b, s, h) = dy.dims3()?;
                let rows = g.comm.reduce_scatter(&g.group, &token_rows(dy)?, 0)?; // [b·s/tp, h]
                rows.reshape((b, s / tp, h))
            }
            (_, false) => Ok(g.comm.all_reduce(&g.group, dy, ReduceOp::Sum)?),
        }
    }

    /// Exit of a row-parallel region: the sum of the ranks' partial `[b, s, h]` results
    /// (reduce-scattered to the ranks' `[b, s/tp, h]` token shares with sequence parallelism).
    pub fn exit(&self, y: &Tensor) -> Result<Tensor> {
        // The same collectives as `enter_grad`: a row-parallel exit sums what a column-parallel
        // entry's backward sums.
        self.enter_grad(y)
    }

    /// The gradient of [`TensorParallel::exit`]'s input from its output's `dy`: all-gathered
    /// from the token shares with sequence parallelism, else `dy` itself.
    pub fn exit_grad(&self, dy: &Tensor) -> Result<Tensor> {
        self.enter(dy)
    }

    /// This rank's share of the tokens of a whole `[b, s, h]` tensor between regions (its rows
    /// of the flat token list, [`token_rows`]), `[b, s/tp, h]`; `x` itself without sequence
    /// parallelism.
    pub fn token_share(&self, x: &Tensor) -> Result<Tensor> {
        if !self.splits_sequence() {
            return Ok(x.clone());
        }
        let (b, s, h) = x.dims3()?;
        let (tp, rows) = (self.size(), b * s / self.size());
        token_rows(x)?
            .narrow(0, self.index() * rows, rows)?
            .reshape((b, s / tp, h))
    }

    /// Whether each rank holds only its share of the tokens between regions (sequence
    /// parallelism over more than one rank).
    pub fn splits_sequence(&self) -> bool {
        self.sequence_parallel && self.size() > 1
    }

    /// Sums host values over the ranks the sequence is split over
    /// ([`TensorParallel::splits_sequence`]); the values themselves otherwise. Every member
    /// calls it alike (one all-reduce).
    pub fn sum_over_sequence(&self, values: Vec<f64>) -> Result<Vec<f64>> {
        if !self.splits_sequence() {
            return Ok(values);
        }
        let (g, len) = (&self.group, values.len());
        g.comm
            .all_reduce(
                &g.group,
                &Tensor::from_vec(values, len, &Device::Cpu)?,
                ReduceOp::Sum,
            )?
            .to_device(&Device::Cpu)?
            .to_vec1::<f64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn local_ids_and_ownership_of_a_vocabulary_slice() {
        // Vocabulary of 16 over 4 ranks; this rank owns ids 8..12.
        let ids = Tensor::new(&[0u32, 5, 8, 9, 11, 12, 15], &Device::Cpu).unwrap();
        let (local, mask) = local_vocab_ids(&ids, 8, 4, 4, "test id").unwrap();
        assert_eq!(local.to_vec1::<u32>().unwrap(), vec![0, 0, 0, 1, 3, 3, 3]);
        assert_eq!(
            mask.to_vec1::<f32>().unwrap(),
            vec![0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
        );
        let bad = Tensor::new(&[3u32, 16], &Device::Cpu).unwrap();
        let e = local_vocab_ids(&bad, 8, 4, 4, "test id").unwrap_err();
        assert!(
            e.to_string()
                .contains("test id 16 is outside the vocabulary of 16"),
            "{e}"
        );
    }
}
