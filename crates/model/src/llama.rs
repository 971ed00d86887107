//! The Llama decoder: token embedding, `num_hidden_layers` pre-norm blocks (grouped-query attention
//! with rotary embeddings, SwiGLU MLP), final RMSNorm and the output projection, with Hugging Face
//! parameter names.
//!
//! A rank holds the part of the model its [`Placement`] names (all of it on one rank; a layer range
//! with an optional embedding and head on a pipeline stage) split across its tensor-parallel group
//! as the TP plan says. The model never calls a collective itself: tensor parallelism enters only
//! through `TensorParallel::{enter, exit}` around the column/row-parallel regions and through the
//! vocab-parallel embedding and loss. The model is cut into segments (embedding, each block, head
//! with loss) that [`crate::segment`] runs with separate autograd graphs.

use std::collections::BTreeMap;
use std::sync::Mutex;

use candle_core::{DType, Device, Result, Tensor};
use parallel::cp::{ContextParallel, Kernels};
use parallel::ep::ExpertParallel;
use parallel::tp::TensorParallel;

use crate::config::LlamaConfig;
use crate::inventory::{Inventory, MlpParams, MoeParams};
use crate::moe::{self, Expert, LayerStats, Router};
use crate::ops::{self, linear, linear_to};
use crate::params::{ParamSet, ParamSpec};

mod backward;
mod head;
pub(crate) use backward::projection_bwd;
pub use backward::BlockTape;
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
    /// What the MoE layers measured in training forwards since [`Llama::take_moe_stats`].
    moe_stats: Mutex<Vec<LayerStats>>,
    /// Per MoE layer, the experts' selection biases (auxiliary-loss-free balancing; empty
    /// without it, and all zero until [`Llama::set_expert_bias`]).
    expert_bias: Mutex<BTreeMap<usize, Vec<f32>>>,
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
            params.add(spec, seed, &placement.tp, dtype, device)?;
        }
        let (cos, sin) = rope_tables(config, dtype, device)?;
        Ok(Self {
            config: config.clone(),
            placement,
            params,
            inventory,
            cos,
            sin,
            moe_stats: Mutex::new(Vec::new()),
            expert_bias: Mutex::new(BTreeMap::new()),
        })
    }

    /// The MoE layers' measurements of the training forwards run since the last call, one
    /// entry per layer and forward (a recomputed forward measures again, identically).
    pub fn take_moe_stats(&self) -> Vec<LayerStats> {
        std::mem::take(&mut *self.moe_stats.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Sets the MoE layers' expert selection biases (by global layer index; a layer not given
    /// routes without a bias). Used only when `router_bias_update_rate` is set.
    pub fn set_expert_bias(&self, bias: &BTreeMap<usize, Vec<f32>>) {
        *self.expert_bias.lock().unwrap_or_else(|e| e.into_inner()) = bias.clone();
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

    /// Token ids `[b, s]` → hidden states `[b, s, h]` (`[b, s / tp, h]` with sequence parallelism).
    pub fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        let e = self
            .inventory
            .embed_tokens
            .filter(|_| self.placement.embedding)
            .ok_or_else(|| self.missing("embedding"))?;
        let vocab = self.params.get(e).block.range(0); // this rank's vocabulary ids
        self.placement
            .tp
            .embedding(tokens, &self.w(e)?, vocab.start, ops::embedding)
    }

    /// Decoder block `i`: `[b, s, h]` → `[b, s, h]` (sequence-sharded with sequence parallelism;
    /// with context parallelism `s` is this rank's share of the sequence).
    pub fn block(&self, i: usize, x: &Tensor) -> Result<Tensor> {
        self.block_with(i, x, None)
    }

    /// [`Llama::block`]; in training (`aux_scale` given) a MoE layer adds its router losses
    /// times `aux_scale` to the objective (riding on the output) and records its measurements.
    fn block_with(&self, i: usize, x: &Tensor, aux_scale: Option<f64>) -> Result<Tensor> {
        let c = &self.config;
        let blk = self
            .inventory
            .blocks
            .get(&i)
            .ok_or_else(|| self.missing(&format!("layer {i}")))?;
        let (tp, tp_size) = (&self.placement.tp, self.placement.tp.size());
        let (hq, hkv, d) = (
            c.num_attention_heads / tp_size,
            c.num_key_value_heads / tp_size,
            c.head_dim(),
        );

        let h = ops::rms_norm(x, &self.w(blk.input_layernorm)?, c.rms_norm_eps)?; // [b, s(/tp), h]
        let h = tp.enter(&h)?; // [b, s, h]
        let (b, s, _) = h.dims3()?; // s: this rank's rows of the sequence
        let cp = &self.placement.cp;
        let (cos, sin) = cp.rope_rows(&self.cos, &self.sin, s * cp.size())?; // global positions
        let q = linear_to(&h, &self.w(blk.q_proj)?, (b, s, hq, d))?; // [b, s, hq/tp, d]
        let k = linear_to(&h, &self.w(blk.k_proj)?, (b, s, hkv, d))?; // [b, s, hkv/tp, d]
        let v = linear_to(&h, &self.w(blk.v_proj)?, (b, s, hkv, d))?;
        let (q, k) = (ops::rope(&q, &cos, &sin)?, ops::rope(&k, &cos, &sin)?);
        let a = cp.attention(&q, &k, &v, 1.0 / (d as f64).sqrt(), KERNELS)?; // [b, s, hq/tp, d]
        let o = linear_to(&a, &self.w(blk.o_proj)?, (b, s, c.hidden_size))?; // [b, s, h] partial
        let x = (x + tp.exit(&o)?)?;

        let norm = self.w(blk.post_attention_layernorm)?;
        let normed = ops::rms_norm(&x, &norm, c.rms_norm_eps)?; // [b, s(/tp), h]
        match &blk.mlp {
            MlpParams::Dense {
                gate_proj,
                up_proj,
                down_proj,
            } => {
                let h = tp.enter(&normed)?; // [b, s, h]
                let g = ops::swiglu(
                    &linear(&h, &self.w(*gate_proj)?)?,
                    &linear(&h, &self.w(*up_proj)?)?,
                )?; // [b, s, f/tp]
                x + tp.exit(&linear(&g, &self.w(*down_proj)?)?)?
            }
            MlpParams::Moe(m) => {
                let parts = self.moe_parts(i, m, aux_scale.is_some(), false)?;
                let split = self.moe_split();
                let ep = &self.placement.ep;
                let h = normed.flatten_to(1)?; // [b·s(/tp), h]
                let out = moe::forward(
                    &h,
                    &parts.router(),
                    &parts.experts,
                    ep,
                    split,
                    &parts.cfg,
                    i,
                )?;
                let y = (x + out.y.reshape(normed.shape())?)?; // [b, s(/tp), h]
                let Some(scale) = aux_scale else {
                    return Ok(y);
                };
                let aux = (out.aux_loss * (scale / c.num_moe_layers() as f64))?;
                self.record_moe(out.stats);
                ops::with_side_loss(&y, &aux)
            }
        }
    }

    /// What MoE layer `layer` (parameters `m`)'s forward needs: the settings (dropless in
    /// evaluation, `train` false), the router with its selection bias, and this rank's experts
    /// (`detached` for a hand-written pass).
    fn moe_parts(
        &self,
        layer: usize,
        m: &MoeParams,
        train: bool,
        detached: bool,
    ) -> Result<MoeParts> {
        let mut cfg = self
            .config
            .moe()
            .ok_or_else(|| self.missing("MoE configuration"))?;
        if !train {
            cfg.capacity_factor = None; // evaluation is dropless
        }
        let w = |i: usize| {
            let t = self.w(i)?;
            Ok::<_, candle_core::Error>(if detached { t.detach() } else { t })
        };
        let experts = m
            .experts
            .iter()
            .map(|e| {
                Ok(Expert {
                    w1: w(e.w1)?,
                    w3: w(e.w3)?,
                    w2: w(e.w2)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let bias = (cfg.bias_update_rate > 0.0)
            .then(|| {
                let biases = self.expert_bias.lock().unwrap_or_else(|e| e.into_inner());
                biases.get(&layer).cloned()
            })
            .flatten();
        Ok(MoeParts {
            cfg,
            weight: w(m.router)?,
            bias,
            experts,
        })
    }

    /// The group a MoE layer's tokens are split over: the tensor-parallel group under sequence
    /// parallelism. The experts are not split over the tensor-parallel group: each rank routes
    /// the tokens it holds (with sequence parallelism its share, whose balancing statistics are
    /// summed over the group; without, all of them, like its peers).
    fn moe_split(&self) -> Option<&parallel::tp::TpGroup> {
        let tp = &self.placement.tp;
        (tp.sequence_parallel && tp.size() > 1).then_some(&tp.group)
    }

    /// Keeps a training forward's MoE measurements for [`Llama::take_moe_stats`].
    fn record_moe(&self, stats: LayerStats) {
        self.moe_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(stats);
    }

    /// Final norm and this rank's output projection: `[b, s(/tp), h]` → logits `[b * s, v / tp]`
    /// in the model dtype.
    fn local_logits(&self, x: &Tensor) -> Result<Tensor> {
        let (norm, head) = self
            .inventory
            .norm
            .zip(self.inventory.lm_head)
            .ok_or_else(|| self.missing("head"))?;
        let h = self.placement.tp.enter(&ops::rms_norm(
            x,
            &self.w(norm)?,
            self.config.rms_norm_eps,
        )?)?; // [b, s, h]
        linear(&h.flatten_to(1)?, &self.w(head)?)
    }

    /// Per-position next-token losses `[b * s]` from the last hidden states; identical on every
    /// tensor-parallel rank. The full logits are never gathered across ranks.
    pub fn losses(&self, x: &Tensor, labels: &Tensor) -> Result<Tensor> {
        // The vocab-parallel loss is built from candle ops over f32 logits; the single-rank one
        // reads the model-dtype logits and sums in f32 (no f32 copy of the logits on a GPU).
        let logits = self.local_logits(x)?; // [b * s, v/tp]
        let logits = if self.placement.tp.size() > 1 {
            logits.to_dtype(DType::F32)?
        } else {
            logits
        };
        let head = self.inventory.lm_head.ok_or_else(|| self.missing("head"))?;
        let vocab = self.params.get(head).block.range(0); // this rank's vocabulary ids
        self.placement
            .tp
            .cross_entropy(&logits, labels, vocab.start, |l, t| {
                ops::cross_entropy_acc(l, t)?.to_dtype(DType::F32)
            })
    }

    /// Head segment: the micro-batch's summed masked cross-entropy times `targets.loss_scale`.
    pub fn head_loss(&self, x: &Tensor, targets: &Targets) -> Result<Tensor> {
        (self.losses(x, &targets.labels)? * &targets.loss_mask)?.sum_all()? * targets.loss_scale
    }

    /// Piece `piece`'s forward in training: token ids → hidden states (embedding), hidden →
    /// hidden (block), hidden → this micro-batch's scaled loss (head).
    pub fn piece_forward(&self, piece: Piece, x: &Tensor, targets: &Targets) -> Result<Tensor> {
        match piece {
            Piece::Embedding => self.embed(x),
            Piece::Block(i) => self.block_with(i, x, Some(targets.aux_scale)),
            Piece::Head => self.head_loss(x, targets),
        }
    }

    /// Full logits `[b * s, v]` (f32) of a whole model on one rank (evaluation, export parity).
    pub fn logits(&self, tokens: &Tensor) -> Result<Tensor> {
        let p = &self.placement;
        if p.tp.size() > 1 || p.cp.size() > 1 || p.ep.size() > 1 || !p.embedding {
            candle_core::bail!("full logits need the whole model on one rank");
        }
        self.local_logits(&self.hidden(tokens)?)?
            .to_dtype(DType::F32)
    }

    /// Embedding and every block held, without segments: `[b, s]` → `[b, s(/tp), h]`.
    pub fn hidden(&self, tokens: &Tensor) -> Result<Tensor> {
        let mut x = self.embed(tokens)?;
        for &i in &self.placement.layers {
            x = self.block(i, &x)?;
        }
        Ok(x)
    }

    /// Full forward without segments (evaluation, tests) on a rank holding the embedding and the
    /// head: per-position losses `[b * s]`.
    pub fn token_losses(&self, tokens: &Tensor, labels: &Tensor) -> Result<Tensor> {
        self.losses(&self.hidden(tokens)?, labels)
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

/// The attention kernels of context parallelism's ring.
const KERNELS: Kernels = Kernels {
    causal: ops::causal_attention,
    block: ops::attention_block,
    block_bwd: ops::attention_block_bwd,
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
