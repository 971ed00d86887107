//! Segments: a model piece run on its own, forward then (later) backward.
//!
//! A piece's forward ([`crate::Llama::forward`]) builds no autograd graph: it returns its output
//! and a tape of exactly what its hand-written backward reads, so each piece's saved state is
//! separate and is freed right after that piece's backward. The backward is driven by the
//! gradient of the piece's output, which comes from the next piece, from the next pipeline stage,
//! or (for the head, whose output is the loss) from nowhere. Activation recompute is the same
//! mechanism keeping only the piece's input and re-running its forward inside the backward.
//!
//! [`SegmentRun::held`] measures what a segment keeps for its backward: the distinct storages of
//! its tape (its input included) — the activation memory that the planner predicts.

use std::collections::HashMap;

use candle_core::{Result, Tensor};
use serde::{Deserialize, Serialize};

use crate::llama::{Forward, Tape};
use crate::moe::LayerStats;
use crate::{Llama, Piece, Targets};

/// What a segment keeps between its forward and its backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep the whole tape (all saved activations) until backward.
    #[default]
    None,
    /// Keep the tape without the modules [`Llama::set_recomputed`](crate::Llama::set_recomputed)
    /// names (`train.recompute_modules`); the block's backward recomputes them.
    Selective,
    /// Keep only the segment's input; re-run its forward during backward.
    Full,
}

/// A part of a decoder block's tape that `recompute: selective` drops and the block's backward
/// recomputes (Megatron's `--recompute-modules` names where they mean the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecomputeModule {
    /// Both RMS norms' outputs as the projections read them (`[n, h]` each; under sequence
    /// parallelism recomputing includes the all-gather). Cheap, memory-heavy.
    Layernorm,
    /// The dense MLP's SwiGLU output `[n, f/tp]`, from the kept gate and up projections.
    MlpAct,
    /// Each expert's SwiGLU output `[rows, f_e]`, from its kept gate and up projections.
    MoeAct,
    /// Attention's output and log-sum-exp, from the kept q, k, v: one more attention forward
    /// (under context parallelism, one more ring) per backward.
    CoreAttn,
}

impl RecomputeModule {
    /// The modules recomputed when a recipe names none: the cheap, memory-heavy ones.
    pub const DEFAULT: [RecomputeModule; 3] = [
        RecomputeModule::Layernorm,
        RecomputeModule::MlpAct,
        RecomputeModule::MoeAct,
    ];
}

/// The set of modules a block's forward drops from its tape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Recomputed {
    /// [`RecomputeModule::Layernorm`].
    pub layernorm: bool,
    /// [`RecomputeModule::MlpAct`].
    pub mlp_act: bool,
    /// [`RecomputeModule::MoeAct`].
    pub moe_act: bool,
    /// [`RecomputeModule::CoreAttn`].
    pub core_attn: bool,
}

impl Recomputed {
    /// The modules dropped under `recompute` (only `selective` drops any) from `modules`.
    pub fn of(recompute: Recompute, modules: &[RecomputeModule]) -> Self {
        let mut r = Recomputed::default();
        if recompute != Recompute::Selective {
            return r;
        }
        for m in modules {
            match m {
                RecomputeModule::Layernorm => r.layernorm = true,
                RecomputeModule::MlpAct => r.mlp_act = true,
                RecomputeModule::MoeAct => r.moe_act = true,
                RecomputeModule::CoreAttn => r.core_attn = true,
            }
        }
        r
    }
}

impl std::fmt::Display for Recompute {
    /// The recipe's name of the mode.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        })
    }
}

impl Recompute {
    /// The mode for `piece`: only decoder blocks are recomputed; the embedding and the head keep
    /// their (small) tapes.
    pub fn for_piece(self, piece: Piece) -> Recompute {
        if matches!(piece, Piece::Block(_)) {
            self
        } else {
            Recompute::None
        }
    }
}

/// The forward state of one segment that its backward pass needs.
pub struct SegmentRun {
    /// The input (kept for a recompute; a tape holds it otherwise).
    input: Tensor,
    /// The tape, unless recomputing.
    tape: Option<Tape>,
}

/// Storages a segment keeps alive: `(storage key, bytes)`, one entry per distinct storage. Equal
/// keys are the same allocation, so several segments' lists can be merged without double
/// counting (a block's output is the next block's input).
pub type Held = Vec<(usize, usize)>;

/// Which storage `t` views: equal keys are one allocation (its read lock taken and dropped, so
/// never call it while holding that storage's lock).
pub(crate) fn storage_key(t: &Tensor) -> usize {
    std::ptr::from_ref(&*t.storage_and_layout().0) as usize
}

/// The key and the bytes a tensor's view covers of its storage (its offset plus the span from
/// its first element to its last, which for a strided view such as a range of a wider
/// matrix's columns passes its own elements; a storage's size is the largest of its views').
fn storage_of(t: &Tensor) -> (usize, usize) {
    let key = storage_key(t);
    let layout = t.layout();
    let span = match t.elem_count() {
        0 => 0,
        _ => {
            let steps = layout.dims().iter().zip(layout.stride());
            1 + steps.map(|(&d, &s)| (d - 1) * s).sum::<usize>()
        }
    };
    let elems = layout.start_offset() + span;
    (key, elems * t.dtype().size_in_bytes())
}

/// The shapes a tape's bytes follow, for one micro-batch on one rank (the planner's view of
/// [`Tape::held`](crate::Tape::held), exact on the tiny layouts): `n` tokens of this rank's
/// share of the micro-batch (`n_s` between tensor-parallel regions: `n / t` with sequence
/// parallelism), `t` tensor-parallel ranks, `p` bytes per element of the model dtype, hidden
/// size `h`.
#[derive(Debug, Clone, Copy)]
pub struct TapeShape {
    /// Fused ops compute 16-bit inputs in f32 (the CPU path), so attention's saved output is f32.
    pub upcast: bool,
    /// Tokens in the tensor-parallel regions.
    pub n: u64,
    /// Tokens between them.
    pub ns: u64,
    /// Tensor-parallel ranks.
    pub t: u64,
    /// Bytes per element of the model dtype.
    pub p: u64,
    /// Hidden size.
    pub h: u64,
    /// Attention is context parallelism's ring (whose output is kept in the model dtype).
    pub ring: bool,
    /// What blocks drop from their tapes (`recompute: selective`).
    pub recomputed: Recomputed,
}

impl TapeShape {
    /// Bytes per element of the accumulation dtype (f32; f64 for f64 models).
    pub fn acc(&self) -> u64 {
        if self.p == 8 {
            8
        } else {
            4
        }
    }
}

/// The distinct storages of `tensors`.
pub fn storages(tensors: &[&Tensor]) -> Held {
    let mut held: HashMap<usize, usize> = HashMap::new();
    for t in tensors {
        let (key, bytes) = storage_of(t);
        let e = held.entry(key).or_default();
        *e = (*e).max(bytes);
    }
    held.into_iter().collect()
}

/// How many of `tensors` carry an autograd graph (a variable or an op's result tracked for
/// backpropagation). The pieces never build one: every count the step makes is zero.
pub fn tracked(tensors: &[&Tensor]) -> usize {
    tensors.iter().filter(|t| t.track_op()).count()
}

impl SegmentRun {
    /// The storages this run keeps until its backward: its tape, or under recompute its input.
    pub fn held(&self) -> Held {
        match &self.tape {
            Some(tape) => tape.held(),
            None => storages(&[&self.input]),
        }
    }

    /// The tensors it keeps that carry an autograd graph (see [`tracked`]).
    pub fn tracked(&self) -> usize {
        match &self.tape {
            Some(tape) => tracked(&tape.tensors()),
            None => tracked(&[&self.input]),
        }
    }
}

/// One parameter's gradient from a backward pass.
pub enum ParamGrad {
    /// The gradient itself, in the parameter's shape.
    Tensor(Tensor),
    /// A projection's weight gradient `gᵀ · x` (`[out, in]`) left as its factors, the upstream
    /// gradient `g` `[rows, out]` and the input `x` `[rows, in]`, so that the gradient buffer can
    /// accumulate the product with one GEMM (no `[out, in]` temporary and no separate addition).
    Product {
        /// `[rows, out]`.
        g: Tensor,
        /// `[rows, in]`.
        x: Tensor,
    },
    /// The weight gradient of a linear with FP8 GEMMs: the same factors as FP8 operands, which
    /// the gradient buffer multiplies as an FP8 GEMM (`g` in E5M2, `x` in E4M3, tensorwise; on
    /// CUDA their transposed codes, made with the codes the input gradient read, and `x`'s
    /// shared by the linears that read it; elsewhere their rounded values).
    Fp8Product {
        /// `[rows, out]`.
        g: crate::ops::Fp8Operand,
        /// `[rows, in]`.
        x: crate::ops::Fp8Operand,
    },
}

impl ParamGrad {
    /// The gradient as one tensor (the product computed for [`ParamGrad::Product`]).
    pub fn into_tensor(self) -> Result<Tensor> {
        match self {
            ParamGrad::Tensor(t) => Ok(t),
            // A factor may be a range of a wider gradient's columns, which candle's CUDA matmul
            // does not take transposed: copied out first.
            ParamGrad::Product { g, x } => g.contiguous()?.t()?.matmul(&x),
            ParamGrad::Fp8Product { g, x } => crate::ops::fp8_product(&g, &x),
        }
    }

    /// Whether it is a product's factors (either kind), which a split backward defers.
    pub fn is_product(&self) -> bool {
        !matches!(self, ParamGrad::Tensor(_))
    }

    /// The same gradient with `f` applied to a product's two factors.
    pub fn map_factors<E>(
        self,
        f: impl Fn(Tensor) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<Self, E> {
        Ok(match self {
            ParamGrad::Tensor(t) => ParamGrad::Tensor(t),
            ParamGrad::Product { g, x } => ParamGrad::Product { g: f(g)?, x: f(x)? },
            ParamGrad::Fp8Product { g, x } => ParamGrad::Fp8Product {
                g: g.map_tensor(&f)?,
                x: x.map_tensor(&f)?,
            },
        })
    }

    /// The tensors it holds.
    pub fn tensors(&self) -> Vec<&Tensor> {
        match self {
            ParamGrad::Tensor(t) => vec![t],
            ParamGrad::Product { g, x } => vec![g, x],
            ParamGrad::Fp8Product { g, x } => vec![g.tensor(), x.tensor()],
        }
    }
}

/// What a segment's backward pass produced.
pub struct Backward {
    /// The gradients of the segment's parameters, by parameter index.
    pub grads: Vec<(usize, ParamGrad)>,
    /// The input's gradient (none for token ids).
    pub dx: Option<Tensor>,
    /// Under recompute: the storages of the tape rebuilt for this backward (held until it ends,
    /// on top of everything else live).
    pub recomputed: Held,
}

/// Runs `piece` of `model` on `x` for the micro-batch `targets` as a segment. Returns the output
/// and the state for [`backward`], and a MoE layer's routing measurements.
pub fn forward(
    model: &Llama,
    piece: Piece,
    x: &Tensor,
    targets: &Targets,
    recompute: Recompute,
) -> Result<(Tensor, SegmentRun, Option<LayerStats>)> {
    let Forward { y, tape, moe } = model.forward(piece, x, targets)?;
    let tape = match recompute {
        // Under `selective` the model already left the recomputed modules out of the tape.
        Recompute::None | Recompute::Selective => Some(tape),
        Recompute::Full => None, // dropped here; the backward rebuilds it
    };
    let run = SegmentRun {
        input: x.clone(),
        tape,
    };
    Ok((y, run, moe))
}

/// Back-propagates through a segment of `piece` run by [`forward`]. `dy` is the gradient of the
/// loss with respect to the segment's output, or `None` when the output is the loss itself.
pub fn backward(
    model: &Llama,
    piece: Piece,
    run: SegmentRun,
    targets: &Targets,
    dy: Option<&Tensor>,
) -> Result<Backward> {
    let (tape, recomputed) = match run.tape {
        Some(tape) => (tape, Held::new()),
        None => {
            let tape = model.forward(piece, &run.input, targets)?.tape;
            let held = tape.held();
            (tape, held)
        }
    };
    let g = model.backward(tape, dy)?;
    Ok(Backward {
        grads: g.params,
        dx: g.dx,
        recomputed,
    })
}
