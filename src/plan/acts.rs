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
    /// The attention backward's workspace on cuDNN ([`cudnn_workspace`]).
    attention_workspace: u64,
    /// The blocks whose linears run in FP8 (`train.fp8`).
    fp8: Option<model::Fp8Linears>,
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
            attention_workspace: cudnn_workspace(r),
            fp8: train.fp8.linears(c.num_hidden_layers),
        }
    }

    /// The emulated FP8 path's copies in block `i`'s backward (`train.fp8`): each input
    /// rounded along the tokens (once for the linears that read it: q, k, v; gate, up) and
    /// each upstream gradient rounded, kept as the weight gradients' factors; a MoE block's
    /// experts stay in the model dtype.
    fn fp8_temp(&self, i: usize) -> u64 {
        if !self.fp8.as_ref().is_some_and(|f| f.layers.contains(&i)) {
            return 0;
        }
        let (c, s) = (self.c, &self.shapes);
        let (n, t, h) = (s.n, s.t, s.h);
        let q = c.q_dim() as u64 / t;
        let kv = (c.num_key_value_heads * c.head_dim()) as u64 / t;
        let f = c.intermediate_size as u64 / t;
        let (inputs, grads) = match c.is_moe_layer(i) {
            true => (h + q, q + 2 * kv + h),
            false => (2 * h + q + f, q + 2 * kv + 2 * h + 2 * f),
        };
        s.p * n * (inputs + grads)
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
                        + rebuilt(i)
                        + self.attention_workspace
                        + self.fp8_temp(i),
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
                    + rebuilt(i)
                    + self.attention_workspace
                    + self.fp8_temp(i),
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

/// The workspace, bytes, of one attention backward on cuDNN on a rank of `r` (0 where the
/// project's kernels run: the CPU, f32, `train.attention: own`, head dims cuDNN does not take).
/// The deterministic algorithm keeps a partial f32 dQ per tile of 128 keys and one more, and the
/// f32 statistics: `4 · b · hq/t · s · (d · (⌈s_k/128⌉ + 1) + 1)` for `b` sequences of `s`
/// local positions (`seq_len / cp`, a ring block's queries and keys) — 570,949,888 bytes
/// measured for 2 × 2048 positions and 32 heads of 64 (cuDNN 9.19, H200), this formula's value
/// to 256 bytes.
/// It grows with the square of the sequence: 2.2 GB a call for 32 heads of 128 at 4096. With
/// documents kept apart the call is a ragged batch whose backward stays within
/// [`model::ops::sdpa::RAGGED_DETERMINISTIC_WORKSPACE`] (past it cuDNN's non-deterministic
/// algorithm runs, whose workspace follows the packed tokens: 104,408,192 bytes measured for
/// 4096 tokens and 32 heads of 64, under 13 bytes per token, head and dimension).
pub(super) fn cudnn_workspace(r: &Recipe) -> u64 {
    let (c, train, par) = (&r.model, &r.train, &r.parallel);
    let d = c.head_dim();
    if train.device != DeviceKind::Cuda
        || !train.attention_backend().runs_cudnn(train.dtype.dtype(), d)
    {
        return 0;
    }
    let (b, s) = (train.micro_batch as u64, (train.seq_len / par.cp) as u64);
    let heads = (c.num_attention_heads / par.tp) as u64;
    let dense = 4 * b * heads * s * (d as u64 * (s.div_ceil(128) + 1) + 1);
    if r.data.reset_attention_mask {
        let packed = 13 * b * s * heads * d as u64;
        dense.min(packed.max(model::ops::sdpa::RAGGED_DETERMINISTIC_WORKSPACE as u64))
    } else {
        dense
    }
}

/// Bytes of a piece's input `[n_s, h]`.
fn s_input(s: &TapeShape) -> u64 {
    s.ns * s.h * s.p
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn bench_1b(set: &str) -> Recipe {
        let mut overrides = vec!["train.device=cuda".to_string()];
        overrides.extend((!set.is_empty()).then(|| set.to_string()));
        crate::recipe::load(Path::new("recipes/bench-1b.yaml"), &overrides).unwrap()
    }

    /// The measured workspace of bench-1b's backward, a share of it per tensor-parallel rank, a
    /// quarter per ring block at cp 2, and nothing where cuDNN does not run.
    #[test]
    fn the_cudnn_backward_workspace_is_counted_where_cudnn_runs() {
        let measured = 570_949_888u64;
        let w = cudnn_workspace(&bench_1b(""));
        assert!(w <= measured && measured - w <= 256, "{w}");
        assert_eq!(cudnn_workspace(&bench_1b("parallel.tp=2")), w / 2);
        let ring = cudnn_workspace(&bench_1b("parallel.cp=2"));
        assert_eq!(ring, 4 * 2 * 32 * 1024 * (64 * 9 + 1));
        for off in ["train.attention=own", "train.dtype=f32", "train.device=cpu"] {
            assert_eq!(cudnn_workspace(&bench_1b(off)), 0, "{off}");
        }
        let docs = cudnn_workspace(&bench_1b("data.reset_attention_mask=true"));
        assert_eq!(
            docs,
            model::ops::sdpa::RAGGED_DETERMINISTIC_WORKSPACE as u64
        );
        let (cudnn, own) = (bench_1b(""), bench_1b("train.attention=own"));
        let (acts, own) = (Acts::new(&cudnn), Acts::new(&own));
        assert_eq!(
            acts.of(Piece::Block(0)).temp,
            own.of(Piece::Block(0)).temp + w
        );
    }
}
