//! The Llama decoder: token embedding, `num_hidden_layers` pre-norm blocks (grouped-query attention
//! with rotary embeddings, SwiGLU MLP or a mixture of experts), final RMSNorm and the output
//! projection, with Hugging Face parameter names.
//!
//! A rank holds the part of the model its [`Placement`] names (all of it on one rank; a layer range
//! with an optional embedding and head on a pipeline stage) split across its tensor-parallel group
//! as the TP plan says. The model never calls a collective itself: tensor, context and expert
//! parallelism enter only through the parallel layer's region entries and exits, ring attention,
//! token dispatch and vocab-parallel embedding and loss, each the identity (or the plain kernel)
//! on a one-rank group, so the model has one path for every layout.
//!
//! Each piece (the embedding, a decoder block, the head with its loss) has one forward, which
//! builds no autograd graph and keeps a [`Tape`] of what its hand-written backward reads
//! (`embedding.rs`, `block.rs`, `head.rs`; the block's projections, plain or FP8, in
//! `project.rs`): training, evaluation, the export parity gate and the self-test all run it. [`crate::segment`] runs the pieces one by one (recompute keeps only a
//! piece's input and re-runs its forward inside the backward).

use std::collections::BTreeMap;

use candle_core::{DType, Device, Result, Tensor};
use parallel::cp::{ContextParallel, DocumentStarts};
use parallel::ep::ExpertParallel;
use parallel::tp::{EmbeddingKernels, LossKernels, TensorParallel};

use crate::config::LlamaConfig;
use crate::inventory::{BlockParams, Inventory, MoeParams};
use crate::moe::{Expert, LayerStats, Router};
use crate::ops::{self, AttentionBackend};
use crate::params::{ParamSet, ParamSpec};
use crate::segment::{storages, Held, ParamGrad};

mod block;
mod embedding;
mod fp8;
mod head;
mod logits;
mod project;
pub use block::BlockTape;
pub use embedding::EmbeddingTape;
pub use fp8::{
    input_operand as fp8_input_operand, linear_to as fp8_linear_to,
    projection_bwd as fp8_projection_bwd, projection_bwd_of as fp8_projection_bwd_of,
    weight_operand as fp8_weight_operand, Fp8Gemm, Fp8Linears, Fp8Mode, Fp8Scaling,
};
pub use head::HeadTape;

/// A piece of the model run as one segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Piece {
    /// Token ids `[b, s]` → hidden states `[b, s, h]`.
    Embedding,
    /// Decoder block `i` (global layer index): `[b, s, h]` → `[b, s, h]`.
    Block(usize),
    /// Final norm, output projection and the loss: `[b, s, h]` → scalar.
    Head,
}

/// Which part of the model a rank holds, and its tensor- and context-parallel groups.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Tensor-parallel group (a one-rank group without tensor parallelism).
    pub tp: TensorParallel,
    /// Context-parallel group (a one-rank group without context parallelism): the rank holds
    /// its share of every sequence, and attention runs as a ring over the group.
    pub cp: ContextParallel,
    /// Expert-parallel group (a one-rank group without expert parallelism): the rank holds its
    /// share of every MoE layer's experts and exchanges tokens with the group.
    pub ep: ExpertParallel,
    /// Global indices of the decoder blocks held, in execution order.
    pub layers: Vec<usize>,
    /// Holds the token embedding (first pipeline stage).
    pub embedding: bool,
    /// Holds the final norm, output projection and loss (last pipeline stage).
    pub head: bool,
}

impl Placement {
    /// The whole model on one rank.
    pub fn whole(config: &LlamaConfig) -> Self {
        Self {
            tp: TensorParallel::single(),
            cp: ContextParallel::single(),
            ep: ExpertParallel::single(),
            layers: (0..config.num_hidden_layers).collect(),
            embedding: true,
            head: true,
        }
    }
}

/// Targets of one micro-batch, for the head segment.
#[derive(Debug, Clone)]
pub struct Targets {
    /// Next-token ids, `[b * s]` u32.
    pub labels: Tensor,
    /// 1 where the position counts in the loss, else 0; `[b * s]` f32.
    pub loss_mask: Tensor,
    /// Factor applied to this micro-batch's summed loss so that the sum over all micro-batches is
    /// the mean over the global batch's counted tokens: `1 / counted tokens in the global batch`.
    pub loss_scale: f64,
    /// Factor applied to this micro-batch's router losses (computed per micro-batch) so that
    /// their sum over the step is their mean over the global batch's micro-batches:
    /// `1 / (micro-batches per rank × data-parallel ranks)`.
    pub aux_scale: f64,
    /// Where the micro-batch's documents start (whole sequences, every context-parallel share),
    /// when they are kept apart (see [`Llama::set_documents`]).
    pub documents: Option<DocumentStarts>,
}

/// How a model uses the document starts a micro-batch brings (`data.reset_attention_mask`,
/// `data.reset_position_ids`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DocumentUse {
    /// No position attends to an earlier document.
    pub mask: bool,
    /// RoPE positions restart at each document.
    pub positions: bool,
}

/// A Llama model (or this rank's part of it) whose parameters live in a [`ParamSet`].
#[derive(Debug)]
pub struct Llama {
    config: LlamaConfig,
    placement: Placement,
    params: ParamSet,
    /// Which parameter is which (indices into `params`).
    inventory: Inventory,
    /// `[max_pos, head_dim / 2]` rotary tables in the parameter dtype.
    cos: Tensor,
    sin: Tensor,
    /// Per MoE layer, the experts' selection biases (auxiliary-loss-free balancing; empty
    /// without it, and all zero until [`Llama::set_expert_bias`]).
    expert_bias: BTreeMap<usize, Vec<f32>>,
    /// Which kernels run attention (the project's unless [`Llama::set_attention_backend`] says).
    attention: AttentionBackend,
    /// What blocks leave out of their tapes for their backward to recompute (nothing unless
    /// [`Llama::set_recomputed`] says).
    recomputed: crate::Recomputed,
    /// How blocks use a micro-batch's document starts (not at all unless
    /// [`Llama::set_documents`] says).
    documents: DocumentUse,
    /// Which blocks run their linears in FP8 (none unless [`Llama::set_fp8`] says).
    fp8: Option<fp8::Fp8Linears>,
}

/// What a piece's forward keeps for its backward pass.
pub enum Tape {
    /// The embedding's.
    Embedding(EmbeddingTape),
    /// A decoder block's.
    Block(BlockTape),
    /// The head's.
    Head(HeadTape),
}

impl Tape {
    /// The tensors the tape keeps, its input included.
    pub fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Tape::Embedding(t) => t.tensors(),
            Tape::Block(t) => t.tensors(),
            Tape::Head(t) => t.tensors(),
        }
    }

    /// The storages the tape keeps alive.
    pub fn held(&self) -> Held {
        storages(&self.tensors())
    }
}

/// A piece's training forward: its output, its tape and, for a MoE block, what the layer
/// measured.
pub struct Forward {
    /// The output: hidden states, or the micro-batch's scaled loss (a scalar) from the head.
    pub y: Tensor,
    /// What the backward reads.
    pub tape: Tape,
    /// A MoE layer's routing measurements.
    pub moe: Option<LayerStats>,
}

/// A piece's backward pass: its input's gradient (none for token ids) and its parameters'.
pub struct Gradients {
    /// The gradient of the piece's input.
    pub dx: Option<Tensor>,
    /// The parameters' gradients, by parameter index.
    pub params: Vec<(usize, ParamGrad)>,
}

impl Llama {
    /// Builds this rank's part of the model with seeded, layout-free initialisation: every
    /// parameter equals the corresponding slice of the single-rank model built with `seed`.
    pub fn new(
        config: &LlamaConfig,
        placement: Placement,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::build(config, placement, Some(seed), dtype, device)
    }

    /// This rank's part of the model with every parameter slot empty (released): what ZeRO-3
    /// starts from, installing a piece's parameters only while it runs, so the unsharded model
    /// is never held. [`crate::Parameter::initial_values`] gives any slice of the values
    /// [`Llama::new`] would have installed.
    pub fn declare(
        config: &LlamaConfig,
        placement: Placement,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::build(config, placement, None, dtype, device)
    }

    fn build(
        config: &LlamaConfig,
        placement: Placement,
        seed: Option<u64>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let experts = config.moe().map_or(0, |m| m.num_experts);
        let inventory = Inventory::with_experts(
            config,
            &placement.layers,
            placement.embedding,
            placement.head,
            placement.ep.local_experts(experts),
        );
        let mut params = ParamSet::default();
        for d in &inventory.params {
            let spec = ParamSpec {
                name: &d.name,
                global_shape: &d.global_shape,
                kind: d.kind,
                init: d.init,
            };
            match seed {
                Some(seed) => params.add(spec, seed, &placement.tp, dtype, device)?,
                None => params.declare(spec, &placement.tp, dtype, device)?,
            };
        }
        if seed.is_some() {
            for group in inventory.blocks.values().flat_map(BlockParams::fused) {
                params.pack(&group)?; // back to back: a view for the fused GEMMs
            }
        }
        let (cos, sin) = rope_tables(config, dtype, device)?;
        Ok(Self {
            config: config.clone(),
            placement,
            params,
            inventory,
            cos,
            sin,
            expert_bias: BTreeMap::new(),
            attention: AttentionBackend::Own,
            recomputed: crate::Recomputed::default(),
            documents: DocumentUse::default(),
            fp8: None,
        })
    }

    /// Keeps documents apart in micro-batches that bring their starts ([`Targets::documents`]):
    /// masks attention across them and/or restarts positions at each. A new model does
    /// neither.
    pub fn set_documents(&mut self, documents: DocumentUse) {
        self.documents = documents;
    }

    /// Has blocks leave `recomputed` out of their tapes; their backward recomputes it
    /// (`recompute: selective`). A new model keeps everything.
    pub fn set_recomputed(&mut self, recomputed: crate::Recomputed) {
        self.recomputed = recomputed;
    }

    /// Runs attention on `backend`'s kernels (see [`AttentionBackend`]); a new model runs the
    /// project's.
    pub fn set_attention_backend(&mut self, backend: AttentionBackend) {
        self.attention = backend;
    }

    /// Which kernels run attention.
    pub fn attention_backend(&self) -> AttentionBackend {
        self.attention
    }

    /// Sets the MoE layers' expert selection biases (by global layer index; a layer not given
    /// routes without a bias). Used only when `router_bias_update_rate` is set.
    pub fn set_expert_bias(&mut self, bias: &BTreeMap<usize, Vec<f32>>) {
        self.expert_bias = bias.clone();
    }

    /// Replaces every parameter with values from `value(parameter)`, which returns the row-major
    /// f32 values of this rank's block of it (cast here to the parameter dtype).
    pub fn load_weights<E>(
        &self,
        mut value: impl FnMut(&crate::Parameter) -> std::result::Result<Vec<f32>, E>,
    ) -> std::result::Result<(), E>
    where
        E: From<candle_core::Error>,
    {
        for p in self.params.iter() {
            let v = value(p)?;
            p.set(&Tensor::from_vec(v, p.block.shape.as_slice(), &p.device)?)?;
        }
        Ok(())
    }

    /// The rotary tables `cos, sin`: `[max_position_embeddings, head_dim / 2]`.
    pub fn rope_tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// The model's configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// What this rank holds.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// This rank's trainable parameters.
    pub fn params(&self) -> &ParamSet {
        &self.params
    }

    /// Indices of the parameters a piece uses.
    pub fn piece_params(&self, piece: Piece) -> Vec<usize> {
        self.inventory.piece_params(piece)
    }

    /// The parameter list this part was built from.
    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    fn w(&self, i: usize) -> Result<Tensor> {
        self.params.get(i).tensor()
    }

    fn missing(&self, what: &str) -> candle_core::Error {
        candle_core::Error::Msg(format!(
            "this rank's model part has no {what} ({:?})",
            self.placement.layers
        ))
    }

    /// Piece `piece`'s training forward on micro-batch `targets`: token ids `[b, s]` → hidden
    /// states (embedding), hidden → hidden (block; a MoE layer applies its capacity and weighs
    /// its balancing losses by `targets.aux_scale`), hidden → the micro-batch's scaled loss
    /// (head). Hidden states are `[b, s(/tp), h]`.
    pub fn forward(&self, piece: Piece, x: &Tensor, targets: &Targets) -> Result<Forward> {
        let (y, tape, moe) = match piece {
            Piece::Embedding => {
                let (y, tape) = self.embed(x)?;
                (y, Tape::Embedding(tape), None)
            }
            Piece::Block(i) => {
                let docs = targets.documents.as_ref();
                let (y, tape, moe) = self.block(i, x, Some(targets.aux_scale), docs)?;
                (y, Tape::Block(tape), moe)
            }
            Piece::Head => {
                let (loss, tape) = self.head(x, targets)?;
                (loss, Tape::Head(tape), None)
            }
        };
        Ok(Forward { y, tape, moe })
    }

    /// The backward pass of a piece from its forward's tape and the gradient `dy` of its output
    /// (`None` for the head, whose output is the objective).
    pub fn backward(&self, tape: Tape, dy: Option<&Tensor>) -> Result<Gradients> {
        let need =
            || dy.ok_or_else(|| candle_core::Error::Msg("a piece's backward needs dy".into()));
        let (dx, params) = match tape {
            Tape::Embedding(t) => (None, self.embed_backward(t, need()?)?),
            Tape::Block(t) => {
                let (dx, g) = self.block_backward(t, need()?)?;
                (Some(dx), g)
            }
            Tape::Head(t) => {
                let (dx, g) = self.head_backward(t)?;
                (Some(dx), g)
            }
        };
        Ok(Gradients { dx, params })
    }

    /// Piece `piece`'s forward in evaluation (its tape dropped, MoE layers dropless): token ids
    /// → hidden states, hidden → hidden, hidden → per-position losses `[b·s]` (f32) for `labels`,
    /// identical on every tensor-parallel rank. `documents` as in [`Targets::documents`].
    pub fn eval_forward(
        &self,
        piece: Piece,
        x: &Tensor,
        labels: &Tensor,
        documents: Option<&DocumentStarts>,
    ) -> Result<Tensor> {
        Ok(match piece {
            Piece::Embedding => self.embed(x)?.0,
            Piece::Block(i) => self.block(i, x, None, documents)?.0,
            Piece::Head => self.head_losses(x, labels)?.0,
        })
    }

    /// What MoE layer `layer` (parameters `m`)'s forward needs: the settings (dropless in
    /// evaluation, `train` false), the router with its selection bias, and this rank's experts.
    fn moe_parts(&self, layer: usize, m: &MoeParams, train: bool) -> Result<MoeParts> {
        let mut cfg = self
            .config
            .moe()
            .ok_or_else(|| self.missing("MoE configuration"))?;
        if !train {
            cfg.capacity_factor = None; // evaluation is dropless
        }
        let experts = m
            .experts
            .iter()
            .map(|e| {
                Ok(Expert {
                    w1: self.w(e.w1)?,
                    w3: self.w(e.w3)?,
                    w2: self.w(e.w2)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let bias = (cfg.bias_update_rate > 0.0)
            .then(|| self.expert_bias.get(&layer).cloned())
            .flatten();
        Ok(MoeParts {
            cfg,
            weight: self.w(m.router)?,
            bias,
            experts,
        })
    }
}

/// What a MoE layer's forward reads besides its input (see `Llama::moe_parts`).
struct MoeParts {
    cfg: crate::MoeConfig,
    /// The router weight `[E, h]`.
    weight: Tensor,
    /// The selection bias `[E]` (auxiliary-loss-free balancing).
    bias: Option<Vec<f32>>,
    /// This rank's experts.
    experts: Vec<Expert>,
}

impl MoeParts {
    fn router(&self) -> Router<'_> {
        Router {
            weight: &self.weight,
            bias: self.bias.as_deref(),
        }
    }
}

/// The row gather of the (vocab-parallel) embedding and its gradient.
const EMBEDDING: EmbeddingKernels = EmbeddingKernels {
    lookup: ops::embedding,
    lookup_bwd: ops::embedding_bwd,
};

/// The fused cross-entropy of one tensor-parallel rank.
const LOSS: LossKernels = LossKernels {
    fwd: ops::cross_entropy_acc,
    bwd: ops::cross_entropy_acc_bwd,
};

/// Rotary tables `cos, sin`: `[max_pos, head_dim / 2]`, angle `p · f_i` with the (possibly
/// rescaled) inverse frequencies of [`LlamaConfig::rope_inv_freq`], computed in f64 on the host
/// for every device.
fn rope_tables(c: &LlamaConfig, dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
    let (half, n) = (c.head_dim() / 2, c.max_position_embeddings);
    let inv = c.rope_inv_freq();
    let angles: Vec<f64> = (0..n)
        .flat_map(|p| inv.iter().map(move |f| p as f64 * f))
        .collect();
    let cos: Vec<f64> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f64> = angles.iter().map(|a| a.sin()).collect();
    let t = |v: Vec<f64>| Tensor::from_vec(v, (n, half), device)?.to_dtype(dtype);
    Ok((t(cos)?, t(sin)?))
}

/// Mean of `losses` over positions where `mask` is 1 (for logging); `[n]`, `[n]` → scalar f64.
pub fn masked_mean(losses: &Tensor, mask: &Tensor) -> Result<f64> {
    let num = (losses.to_dtype(DType::F64)? * mask.to_dtype(DType::F64)?)?
        .sum_all()?
        .to_scalar::<f64>()?;
    let den = mask.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    Ok(num / den.max(1.0))
}
