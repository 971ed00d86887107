//! Vocab-parallel embedding: each rank holds rows `vocab_start..vocab_start + v/tp` of the
//! embedding matrix, looks up the ids it owns (zeros elsewhere) and the partial results are summed
//! across the tensor-parallel group (reduce-scattered along the sequence with sequence
//! parallelism). With one rank it is the plain lookup. The backward gathers the output's gradient
//! back to every rank (with sequence parallelism) and scatter-adds the rows this rank owns into
//! its slice of the table's gradient.

use candle_core::{DType, Result, Tensor, D};

use super::TensorParallel;

/// The model's row gather and its gradient (its op library provides them).
#[derive(Clone, Copy)]
pub struct EmbeddingKernels {
    /// Rows `ids` `[n]` (u32) of a table `[v, h]` → `[n, h]`.
    pub lookup: fn(&Tensor, &Tensor) -> Result<Tensor>,
    /// The table's gradient `[v, h]` in `dtype` from the rows' gradient `[n, h]` and their ids
    /// `[n]`: each id's rows summed in position order (`v` rows).
    pub lookup_bwd: fn(&Tensor, &Tensor, usize, DType) -> Result<Tensor>,
}

/// What the embedding's backward reads.
pub struct EmbeddingSaved {
    /// The row of this rank's table each position looked up `[n]` (u32).
    ids: Tensor,
    /// With more than one rank: 1 where this rank holds the position's token, else 0 `[n, 1]`
    /// (the table's dtype).
    mask: Option<Tensor>,
    /// Rows of this rank's table, and its dtype.
    rows: usize,
    dtype: DType,
}

impl EmbeddingSaved {
    /// The tensors kept.
    pub fn tensors(&self) -> Vec<&Tensor> {
        std::iter::once(&self.ids).chain(&self.mask).collect()
    }
}

impl TensorParallel {
    /// Token ids `[b, s]` → hidden states `[b, s, h]` (`[b, s / tp, h]` with sequence
    /// parallelism) from this rank's embedding rows `w` `[v / tp, h]`, which start at vocabulary
    /// id `vocab_start`; and what [`TensorParallel::embedding_bwd`] reads.
    pub fn embedding(
        &self,
        ids: &Tensor,
        w: &Tensor,
        vocab_start: usize,
        kernels: EmbeddingKernels,
    ) -> Result<(Tensor, EmbeddingSaved)> {
        let (b, s) = ids.dims2()?;
        let (rows, h) = w.dims2()?;
        let dtype = w.dtype();
        if self.size() == 1 {
            let ids = ids.flatten_all()?.to_dtype(DType::U32)?; // [b·s]
            let y = (kernels.lookup)(w, &ids)?.reshape((b, s, h))?;
            let saved = EmbeddingSaved {
                ids,
                mask: None,
                rows,
                dtype,
            };
            return Ok((y, saved));
        }
        let (local, mask) = super::local_vocab_ids(
            ids,
            vocab_start,
            rows,
            self.size(),
            "vocab-parallel embedding: token id",
        )?; // [b·s], [b·s]
        let mask = mask.reshape((b * s, 1))?.to_dtype(dtype)?;
        let partial = (kernels.lookup)(w, &local)?
            .broadcast_mul(&mask)?
            .reshape((b, s, h))?; // [b, s, h] partial
        let saved = EmbeddingSaved {
            ids: local,
            mask: Some(mask),
            rows,
            dtype,
        };
        Ok((self.exit(&partial)?, saved))
    }

    /// The gradient of this rank's rows `[v / tp, h]` from the output's gradient `dy`
    /// (`[b, s(/tp), h]`).
    pub fn embedding_bwd(
        &self,
        saved: &EmbeddingSaved,
        dy: &Tensor,
        kernels: EmbeddingKernels,
    ) -> Result<Tensor> {
        let dy = self.exit_grad(dy)?; // [b, s, h]
        let h = dy.dim(D::Minus1)?;
        let dy = dy.reshape(((), h))?; // [b·s, h]
        let dy = match &saved.mask {
            Some(mask) => dy.broadcast_mul(mask)?,
            None => dy,
        };
        (kernels.lookup_bwd)(&dy, &saved.ids, saved.rows, saved.dtype)
    }
}
