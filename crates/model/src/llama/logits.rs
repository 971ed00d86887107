//! Full logits on one rank (evaluation, the export's parity gate), piece by piece: a whole
//! model's logits are its pieces' forwards chained, so a chain of models that each hold one
//! piece gives the same values with one piece's weights alive at a time.

use candle_core::{DType, Result, Tensor};

use super::{Llama, Placement};
use crate::{LlamaConfig, Piece};

impl Placement {
    /// The pieces held, in execution order: the embedding, the blocks, the head.
    pub fn pieces(&self) -> Vec<Piece> {
        let mut pieces = Vec::with_capacity(self.layers.len() + 2);
        if self.embedding {
            pieces.push(Piece::Embedding);
        }
        pieces.extend(self.layers.iter().copied().map(Piece::Block));
        if self.head {
            pieces.push(Piece::Head);
        }
        pieces
    }

    /// One rank holding `piece` alone.
    pub fn of_piece(config: &LlamaConfig, piece: Piece) -> Self {
        Self {
            layers: match piece {
                Piece::Block(i) => vec![i],
                _ => Vec::new(),
            },
            embedding: piece == Piece::Embedding,
            head: piece == Piece::Head,
            ..Self::whole(config)
        }
    }
}

impl Llama {
    /// Full logits `[b * s, v]` (f32) of a whole model on one rank.
    pub fn logits(&self, tokens: &Tensor) -> Result<Tensor> {
        let p = self.placement();
        if !p.embedding || !p.head {
            candle_core::bail!("full logits need the whole model on one rank");
        }
        let mut x = tokens.clone();
        for piece in p.pieces() {
            x = self.logits_forward(piece, &x)?;
        }
        Ok(x)
    }

    /// Piece `piece`'s part of [`Llama::logits`]: token ids `[b, s]` → hidden states
    /// (embedding), hidden → hidden (block, dropless), hidden `[b, s, h]` → full logits
    /// `[b·s, v]` in f32 (head).
    pub fn logits_forward(&self, piece: Piece, x: &Tensor) -> Result<Tensor> {
        let p = self.placement();
        if p.tp.size() > 1 || p.cp.size() > 1 || p.ep.size() > 1 {
            candle_core::bail!("full logits need the model's pieces whole on one rank");
        }
        match piece {
            Piece::Embedding => Ok(self.embed(x)?.0),
            Piece::Block(i) => Ok(self.block(i, x, None, None)?.0),
            Piece::Head => self.head_logits(x)?.1.to_dtype(DType::F32),
        }
    }
}
