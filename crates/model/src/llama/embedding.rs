//! The token embedding with its backward pass: the (vocab-parallel) row gather keeps the rows it
//! looked up, and its backward scatter-adds the output's gradient rows into the table's gradient
//! (`parallel::tp::TensorParallel::{embedding, embedding_bwd}` over `ops::{embedding,
//! embedding_bwd}`: candle's `index_add` in position order on the CPU, our deterministic kernel
//! on CUDA).

use candle_core::{Result, Tensor};
use parallel::tp::EmbeddingSaved;

use super::{Llama, EMBEDDING};
use crate::segment::ParamGrad;

/// What the embedding's forward keeps for its backward pass.
pub struct EmbeddingTape {
    /// The ids and ownership mask the lookup used.
    saved: EmbeddingSaved,
}

impl EmbeddingTape {
    /// The bytes the tape keeps (shapes `s`): the ids it looked up (the token ids themselves on
    /// one rank; under tensor parallelism the local rows, u32, and the ownership mask in the
    /// model dtype).
    pub fn bytes(s: &crate::segment::TapeShape) -> u64 {
        4 * s.n + u64::from(s.t > 1) * s.n * s.p
    }

    /// The tensors the tape keeps.
    pub fn tensors(&self) -> Vec<&Tensor> {
        self.saved.tensors()
    }
}

impl Llama {
    /// The embedding's parameter index, on the rank holding it.
    fn embed_param(&self) -> Result<usize> {
        self.inventory
            .embed_tokens
            .filter(|_| self.placement.embedding)
            .ok_or_else(|| self.missing("embedding"))
    }

    /// Token ids `[b, s]` → hidden states `[b, s, h]` (`[b, s / tp, h]` with sequence
    /// parallelism), and the tape of [`Llama::embed_backward`].
    pub(super) fn embed(&self, tokens: &Tensor) -> Result<(Tensor, EmbeddingTape)> {
        let e = self.embed_param()?;
        let vocab = self.params.get(e).block.range(0); // this rank's vocabulary ids
        let (y, saved) =
            self.placement
                .tp
                .embedding(tokens, &self.w(e)?, vocab.start, EMBEDDING)?;
        Ok((y, EmbeddingTape { saved }))
    }

    /// The embedding table's gradient from the output's `dy` `[b, s(/tp), h]`.
    pub(super) fn embed_backward(
        &self,
        tape: EmbeddingTape,
        dy: &Tensor,
    ) -> Result<Vec<(usize, ParamGrad)>> {
        let e = self.embed_param()?;
        let dw = self
            .placement
            .tp
            .embedding_bwd(&tape.saved, dy, EMBEDDING)?; // [v/tp, h]
        Ok(vec![(e, ParamGrad::Tensor(dw))])
    }
}
