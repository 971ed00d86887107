//! Segments: a model piece run with its own autograd graph.
//!
//! A segment's input is a leaf `Var` and its output is handed on detached, so each piece's graph is
//! separate and is freed right after that piece's backward. The backward pass of a segment is driven
//! by the upstream gradient through [`grad_inject`](crate::ops::grad_inject). The same mechanism
//! serves activation recompute (keep only the input, re-run the forward inside backward) and
//! pipeline stages (the upstream gradient arrives from the next stage).
//!
//! A segment runs as a [`Pass`]: through candle's autograd graph of a forward closure, or as a
//! piece with a hand-written backward (a dense decoder block, [`crate::llama::BlockTape`]; the
//! head, [`crate::llama::HeadTape`]), which keeps a tape of the tensors its backward reads instead
//! of a graph. Recompute works alike for both.
//!
//! [`SegmentRun::held`] and [`graph_storages`] measure what a segment keeps for its backward: the
//! distinct storages of its autograd graph (parameters excluded) and its input — the activation
//! memory that the planner predicts.

use candle_core::backprop::GradStore;
use std::collections::{HashMap, HashSet};

use candle_core::{Result, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::llama::{BlockTape, HeadTape};
use crate::ops::grad_inject;
use crate::Llama;

/// What a segment keeps between its forward and its backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep the whole graph (all intermediate activations) until backward.
    #[default]
    None,
    /// Keep only the segment's input; re-run its forward during backward.
    Full,
}

impl Recompute {
    /// The mode for `piece`: only decoder blocks are recomputed; the embedding and the head keep
    /// their (small) graphs.
    pub fn for_piece(self, piece: crate::Piece) -> Recompute {
        if matches!(piece, crate::Piece::Block(_)) {
            self
        } else {
            Recompute::None
        }
    }
}

/// How the pieces run their backward passes (`train.backward`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackwardMode {
    /// A piece's own backward pass where it has one (dense decoder blocks, the head), autograd
    /// elsewhere (the embedding, MoE blocks).
    #[default]
    HandWritten,
    /// candle's autograd for every piece: the reference the hand-written passes are tested
    /// against.
    Autograd,
}

/// How a segment computes its forward and backward passes.
pub enum Pass<'a> {
    /// `f`'s forward builds an autograd graph; the backward runs through it.
    Graph(&'a dyn Fn(&Tensor) -> Result<Tensor>),
    /// Decoder block `layer` of `model`, forward without a graph, hand-written backward; a
    /// MoE layer's balancing losses weigh the micro-batch's `aux_scale` (see `Targets`).
    Block(&'a Llama, usize, f64),
    /// The head of `model` with the micro-batch's targets, hand-written backward.
    Head(&'a Llama, &'a crate::Targets),
}

/// What a hand-written pass keeps for its backward.
pub enum Tape {
    /// A decoder block's.
    Block(BlockTape),
    /// The head's.
    Head(HeadTape),
}

impl Tape {
    /// The storages the tape keeps alive.
    pub fn held(&self) -> Held {
        match self {
            Tape::Block(t) => t.held(),
            Tape::Head(t) => t.held(),
        }
    }
}

impl Pass<'_> {
    /// The output and, for a hand-written pass, its tape.
    fn run(&self, x: &Tensor) -> Result<(Tensor, Option<Tape>)> {
        match self {
            Pass::Graph(f) => Ok((f(x)?, None)),
            Pass::Block(model, layer, aux_scale) => {
                let (y, tape) = model.block_forward_saved(*layer, x, *aux_scale)?;
                Ok((y, Some(Tape::Block(tape))))
            }
            Pass::Head(model, targets) => {
                let (loss, tape) = model.head_forward_saved(x, targets)?;
                Ok((loss, Some(Tape::Head(tape))))
            }
        }
    }

    /// A hand-written pass's backward from its tape: the input's gradient and the parameters'.
    fn backward(
        &self,
        tape: Tape,
        dy: Option<&Tensor>,
    ) -> Result<(Tensor, Vec<(usize, ParamGrad)>)> {
        match (self, tape, dy) {
            (Pass::Block(model, ..), Tape::Block(tape), Some(dy)) => model.block_backward(tape, dy),
            (Pass::Head(model, _), Tape::Head(tape), None) => model.head_backward(tape),
            _ => candle_core::bail!(
                "a hand-written backward pass got another pass's tape or upstream gradient"
            ),
        }
    }
}

/// The forward state of one segment that its backward pass needs.
pub struct SegmentRun {
    /// The input as a leaf variable (so its gradient is produced), or `None` for inputs that take
    /// no gradient (token ids).
    input: Option<Var>,
    /// The raw input, for inputs without gradient that a recompute needs again.
    raw_input: Tensor,
    /// The output with its graph, kept unless recomputing ([`Pass::Graph`]).
    output: Option<Tensor>,
    /// A hand-written pass's tape, kept unless recomputing.
    tape: Option<Tape>,
}

/// Storages a segment keeps alive: `(storage key, bytes)`, one entry per distinct storage. Equal
/// keys are the same allocation, so several segments' lists can be merged without double
/// counting (a block's output is the next block's input).
pub type Held = Vec<(usize, usize)>;

/// The key and the bytes a tensor's view covers of its storage (its offset plus its elements; a
/// storage's size is the largest of its views' on the graph).
fn storage_of(t: &Tensor) -> (usize, usize) {
    let (storage, layout) = t.storage_and_layout();
    let key = std::ptr::from_ref(&*storage) as usize;
    let elems = layout.start_offset() + t.elem_count();
    (key, elems * t.dtype().size_in_bytes())
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

/// The distinct storages the autograd graph of `root` keeps for its backward pass, plus those of
/// `extra`: every tensor on the graph except variables (parameters, leaf inputs) and views of
/// them.
pub fn graph_storages(root: &Tensor, extra: &[&Tensor]) -> Held {
    let nodes = root.sorted_nodes();
    let vars: HashSet<usize> = nodes
        .iter()
        .filter(|n| n.is_variable())
        .map(|n| storage_of(n).0)
        .collect();
    let mut held: HashMap<usize, usize> = HashMap::new();
    let graph = nodes.iter().copied().filter(|n| !n.is_variable());
    for t in graph.chain(extra.iter().copied()) {
        let (key, bytes) = storage_of(t);
        if extra.iter().any(|e| e.id() == t.id()) || !vars.contains(&key) {
            let e = held.entry(key).or_default();
            *e = (*e).max(bytes);
        }
    }
    held.into_iter().collect()
}

impl SegmentRun {
    /// The storages this run keeps until its backward: its input (and the leaf copy of it) and,
    /// unless recomputing, its forward's graph.
    pub fn held(&self) -> Held {
        if let Some(tape) = &self.tape {
            return tape.held();
        }
        let mut extra = vec![&self.raw_input];
        extra.extend(self.input.as_ref().map(|v| v.as_tensor()));
        match &self.output {
            Some(y) => graph_storages(y, &extra),
            None => graph_storages(&self.raw_input, &extra),
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
}

impl ParamGrad {
    /// The gradient as one tensor (the product computed for [`ParamGrad::Product`]).
    pub fn into_tensor(self) -> Result<Tensor> {
        match self {
            ParamGrad::Tensor(t) => Ok(t),
            ParamGrad::Product { g, x } => g.t()?.matmul(&x),
        }
    }
}

/// The parameter gradients of a segment's backward pass.
pub enum Grads {
    /// Autograd's store, by tensor.
    Graph(GradStore),
    /// A hand-written pass's, by parameter index.
    Params(HashMap<usize, ParamGrad>),
}

impl Grads {
    /// Takes the gradient of parameter `index`, whose tensor is `param`.
    pub fn take(&mut self, index: usize, param: &Tensor) -> Option<ParamGrad> {
        match self {
            Grads::Graph(store) => store.remove(param).map(ParamGrad::Tensor),
            Grads::Params(map) => map.remove(&index),
        }
    }
}

/// What a segment's backward pass produced.
pub struct Backward {
    /// The gradients of the segment's parameters.
    pub grads: Grads,
    /// The input's gradient, if the input takes one.
    pub dx: Option<Tensor>,
    /// Under recompute: the storages of the forward graph rebuilt for this backward (held until
    /// it ends, on top of everything else live).
    pub recomputed: Held,
}

/// Runs `pass` on `x` as a segment. `x_needs_grad` is false for integer inputs (token ids).
/// Returns the detached output and the state for [`backward`].
pub fn forward(
    pass: &Pass,
    x: &Tensor,
    x_needs_grad: bool,
    recompute: Recompute,
) -> Result<(Tensor, SegmentRun)> {
    match (recompute, pass) {
        (Recompute::None, Pass::Graph(f)) => {
            let input = if x_needs_grad {
                Some(Var::from_tensor(x)?)
            } else {
                None
            };
            let y = f(input.as_ref().map(|v| v.as_tensor()).unwrap_or(x))?;
            Ok((
                y.detach(),
                SegmentRun {
                    input,
                    raw_input: x.clone(),
                    output: Some(y),
                    tape: None,
                },
            ))
        }
        (Recompute::None, Pass::Block(..) | Pass::Head(..)) => {
            let (y, tape) = pass.run(x)?;
            Ok((
                y,
                SegmentRun {
                    input: None,
                    raw_input: x.clone(),
                    output: None,
                    tape,
                },
            ))
        }
        (Recompute::Full, _) => {
            // The graph or tape built here is dropped at the end of this scope.
            let (y, _) = pass.run(x)?;
            Ok((
                y.detach(),
                SegmentRun {
                    input: None,
                    raw_input: x.clone(),
                    output: None,
                    tape: None,
                },
            ))
        }
    }
}

/// Back-propagates through a segment run by `pass`. `dy` is the gradient of the loss with
/// respect to the segment's output, or `None` when the output is the (scalar) loss itself.
/// Returns the gradients of the segment's parameters and its input's gradient (if the input
/// takes one).
pub fn backward(
    pass: &Pass,
    run: SegmentRun,
    x_needs_grad: bool,
    dy: Option<&Tensor>,
) -> Result<Backward> {
    let SegmentRun {
        input,
        raw_input,
        output,
        tape,
    } = run;
    if !matches!(pass, Pass::Graph(_)) {
        let (tape, recomputed) = match tape {
            Some(tape) => (tape, Held::new()),
            None => {
                let tape = pass.run(&raw_input)?.1;
                let tape = tape.ok_or_else(|| candle_core::Error::Msg("no tape".into()))?;
                let held = tape.held();
                (tape, held)
            }
        };
        let (dx, grads) = pass.backward(tape, dy)?;
        return Ok(Backward {
            grads: Grads::Params(grads.into_iter().collect()),
            dx: Some(dx),
            recomputed,
        });
    }
    let mut recomputed = Held::new();
    let (input, output) = match output {
        Some(y) => (input, y),
        None => {
            let input = if x_needs_grad {
                Some(Var::from_tensor(&raw_input)?)
            } else {
                None
            };
            let y = pass
                .run(input.as_ref().map(|v| v.as_tensor()).unwrap_or(&raw_input))?
                .0;
            let extra: Vec<&Tensor> = input.iter().map(|v| v.as_tensor()).collect();
            recomputed = graph_storages(&y, &extra);
            (input, y)
        }
    };
    let root = match dy {
        Some(dy) => grad_inject(&output, dy)?,
        None => output,
    };
    let mut grads = root.backward()?;
    let dx = match &input {
        Some(v) => grads.remove(v.as_tensor()),
        None => None,
    };
    Ok(Backward {
        grads: Grads::Graph(grads),
        dx,
        recomputed,
    })
}
