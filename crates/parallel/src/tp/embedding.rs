//! Vocab-parallel embedding: each rank holds rows `vocab_start..vocab_start + v/tp` of the
//! embedding matrix, looks up the ids it owns (zeros elsewhere) and the partial results are summed
//! across the tensor-parallel group (reduce-scattered along the sequence with sequence parallelism).
//! With one rank it is the plain lookup.

use candle_core::{Result, Tensor};

use super::TensorParallel;

/// Token ids `[b, s]` → hidden states `[b, s, h]` (`[b, s / tp, h]` with sequence parallelism)
/// from this rank's rows `w` `[v/tp, h]` starting at vocabulary id `vocab_start`, with
/// `lookup(table, ids)` the differentiable row gather (`[n, h]` for `n` u32 ids).
pub fn vocab_parallel_embedding(
    ids: &Tensor,
    w: &Tensor,
    vocab_start: usize,
    tp: &TensorParallel,
    lookup: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (b, s) = ids.dims2()?;
    let (local_v, h) = w.dims2()?;
    if tp.size() == 1 {
        return lookup(w, &ids.flatten_all()?.to_dtype(candle_core::DType::U32)?)?
            .reshape((b, s, h));
    }
    let (local, mask) = super::local_vocab_ids(
        ids,
        vocab_start,
        local_v,
        tp.size(),
        "vocab-parallel embedding: token id",
    )?; // [b·s], [b·s]
    let mask = mask.reshape((b * s, 1))?.to_dtype(w.dtype())?;
    let e = lookup(w, &local)?
        .broadcast_mul(&mask)?
        .reshape((b, s, h))?; // [b, s, h] partial
    tp.exit(&e)
}
