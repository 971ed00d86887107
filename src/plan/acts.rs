//! What one piece of a recipe's model keeps per micro-batch on one rank ([`Acts`]): its tape,
//! its input, its backward's temporaries, and what a split backward keeps of it until its
//! weight action. The byte formulas of the tapes sit next to them in the model crate
//! (`BlockTape::bytes`, `MoeTape::bytes`, `HeadTape::bytes`, `EmbeddingTape::bytes`); the table
//! is in `memory.rs`.

use model::llama::{BlockTape, EmbeddingTape, HeadTape};
use model::segment::TapeShape;
use model::{Piece, Recomputed};

use crate::recipe::{DeviceKind, Recipe};

/// What one piece keeps per micro-batch, bytes.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct PieceActs {
    /// Its tape (recompute none), excluding its input.
    pub(super) tape: u64,
    /// Its input, when nobody else keeps it.
    pub(super) input: u64,
    /// Gradient temporaries of its backward.
    pub(super) temp: u64,
    /// What a split backward (zero-bubble schedules) keeps of a block until its weight action:
    /// the projections' inputs and upstream gradients, the factors of its weight gradients.
    pub(super) factors: u64,
}

/// The per-micro-batch activation bytes of each piece of a recipe's model on one rank.
pub(super) struct Acts<'a> {
    c: &'a model::LlamaConfig,
    pub(super) shapes: TapeShape,
    /// The same without `recompute: selective`'s leaving out.
    whole: TapeShape,
    /// A split backward's attention factors: the first norm's rows and the attention output
    /// (inputs), the q, k, v and o projections' upstream gradients.
    attention_factors: u64,
}

impl<'a> Acts<'a> {
    pub(super) fn new(r: &'a Recipe) -> Self {
        let (par, train, c) = (&r.parallel, &r.train, &r.model);
        let t = par.tp;
        let p = train.dtype.dtype().size_in_bytes() as u64;
        let n = (train.micro_batch * train.seq_len / par.cp) as u64; // this rank's share
        let shapes = TapeShape {
            upcast: p != 4 && train.device == DeviceKind::Cpu,
            n,
            ns: if par.sequence_parallel {
                n / t as u64
            } else {
                n
            },
            t: t as u64,
            p,
            h: c.hidden_size as u64,
            ring: par.cp > 1,
            recomputed: train.recomputed(),
        };
        let whole = TapeShape {
            recomputed: Recomputed::default(),
            ..shapes
        };
        let qkv = (c.q_dim() + 2 * c.num_key_value_heads * c.head_dim()) as u64;
        let attention_factors = p * n * (2 * shapes.h + (c.q_dim() as u64 + qkv) / shapes.t);
        Self {
            c,
            shapes,
            whole,
            attention_factors,
        }
    }

    /// What `piece` keeps per micro-batch.
    pub(super) fn of(&self, piece: Piece) -> PieceActs {
        let (c, shapes) = (self.c, self.shapes);
        let (n, p) = (shapes.n, shapes.p);
        // What `recompute: selective` leaves out of a block's tape is rebuilt inside its
        // backward and held there, a temporary of that backward.
        let rebuilt =
            |i: usize| BlockTape::bytes(c, &self.whole, i) - BlockTape::bytes(c, &shapes, i);
        // A tape keeps its piece's input but not its output (the next piece's input, counted
        // there).
        let input = s_input(&shapes);
        let attention_factors = self.attention_factors;
        match piece {
            Piece::Embedding => PieceActs {
                tape: EmbeddingTape::bytes(&shapes),
                input: 0,
                temp: shapes.n * shapes.h * p,
                factors: 0,
            },
            Piece::Block(i) if c.is_moe_layer(i) => {
                let rows = shapes.ns * c.moe().map_or(0, |m| (m.top_k * m.expert_size) as u64);
                PieceActs {
                    tape: BlockTape::bytes(c, &shapes, i),
                    input,
                    // The attention projections' factors, the experts' (rows of their input
                    // and upstream gradient), and the gradients of the slots' rows.
                    temp: p
                        * (2 * n * shapes.h
                            + 3 * rows
                            + n * (c.q_dim() + 2 * c.num_key_value_heads * c.head_dim()) as u64
                                / shapes.t)
                        + rebuilt(i),
                    factors: attention_factors
                        + p * shapes.ns
                            * c.moe().map_or(0, |m| {
                                (m.top_k * (2 * c.hidden_size + 3 * m.expert_size)) as u64
                            }),
                }
            }
            Piece::Block(i) => PieceActs {
                tape: BlockTape::bytes(c, &shapes, i),
                input,
                // The projections' upstream gradients, kept as weight-gradient factors until
                // the block's gradients are accumulated, and one MLP-wide temporary.
                temp: p
                    * (2 * n * shapes.h
                        + 3 * n * c.intermediate_size as u64 / shapes.t
                        + n * (c.q_dim() + 2 * c.num_key_value_heads * c.head_dim()) as u64
                            / shapes.t)
                    + rebuilt(i),
                // Inputs: two norms' rows, the attention output, the SwiGLU; upstream
                // gradients: q, k, v, o, gate, up, down. Element for element the block's whole
                // tape and input but the log-sum-exp (the residual's place taken by o's
                // upstream gradient), whatever the recompute left out of the tape: the
                // executor counts the same storages.
                factors: BlockTape::bytes(c, &self.whole, i) + input
                    - 4 * n * c.num_attention_heads as u64 / shapes.t,
            },
            Piece::Head => PieceActs {
                tape: HeadTape::bytes(c, &shapes),
                input,
                temp: 2 * 4 * n * c.vocab_size as u64 / shapes.t,
                factors: 0, // the head's weight gradient is not deferred
            },
        }
    }
}

/// Bytes of a piece's input `[n_s, h]`.
fn s_input(s: &TapeShape) -> u64 {
    s.ns * s.h * s.p
}
