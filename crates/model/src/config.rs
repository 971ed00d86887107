//! `LlamaConfig`: the `model:` section of a recipe, named as in Hugging Face's `LlamaConfig`.

use serde::{Deserialize, Serialize};

pub use crate::moe_config::{CapacityPolicy, MoeConfig};

/// Largest parameter count a model may have (far beyond any trained model; only sizes that
/// cannot exist are refused).
pub const MAX_PARAMS: f64 = 1e13;
/// Largest `num_hidden_layers`: 1024. The deepest trained decoders have a few hundred layers
/// (DeepNet's 1,000-layer model is within); the planner's layout search and the pipeline
/// schedules take time in proportion to the layers.
pub const MAX_LAYERS: usize = 1024;
/// Largest `max_position_embeddings` (the rotary tables are sized by it): 4 Mi positions.
pub const MAX_POSITIONS: usize = 1 << 22;

/// Shape and numerics of a Llama decoder. Field names follow Hugging Face's `config.json`, so an
/// exported `config.json` is this struct plus a few fixed keys.
///
/// `Default` is all zeros and absent options — not a usable model, but the tail of a struct
/// literal that sets the shape and leaves the optional settings (mixture of experts, RoPE
/// scaling, token ids) unset: `LlamaConfig { hidden_size: 64, .., ..Default::default() }`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaConfig {
    /// Rows of the embedding and output matrices. Must be at least the tokenizer's vocabulary size;
    /// larger values pad the vocabulary (e.g. to a multiple of 64 × tensor-parallel size).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU feed-forward layer.
    pub intermediate_size: usize,
    /// Number of decoder blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); must divide `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Dimension of one attention head when it differs from `hidden_size / num_attention_heads`
    /// (the query projection then has `num_attention_heads × head_dim` rows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Base of the rotary embedding frequencies.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// Rescaling of the rotary frequencies (Hugging Face's `rope_scaling`); absent: plain RoPE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// Epsilon inside RMSNorm's square root.
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// Share the input embedding matrix with the output projection (`lm_head`).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Longest sequence the model is trained for (the rotary table's length).
    pub max_position_embeddings: usize,
    /// Standard deviation of the normal initialisation of every matrix; the output projections of
    /// attention and MLP (`o_proj`, `down_proj`) use `init_std / sqrt(2 * num_hidden_layers)`.
    #[serde(default = "default_init_std")]
    pub init_std: f64,
    /// Beginning-of-sequence token id written to exported configs (default: the tokenizer's
    /// end-of-document token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id(s) written to exported configs (default: the tokenizer's
    /// end-of-document token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<TokenIds>,
    /// Experts of each mixture-of-experts layer (Mixtral's name). Absent: every layer has a dense
    /// SwiGLU MLP. Set: the layers not in `mlp_only_layers` route each token to
    /// `num_experts_per_tok` of this many SwiGLU experts (see [`crate::moe`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_local_experts: Option<usize>,
    /// Experts per token (top-k); default 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    /// Weight of the load-balancing loss; default 0.02 (Mixtral 8x7B's published value). The
    /// loss is Hugging Face Mixtral's `E · Σᵢ fᵢ·Pᵢ`, with `fᵢ` the share of tokens that select
    /// expert `i` (the shares sum to `k`; `k` when perfectly balanced) and `Pᵢ` expert `i`'s mean
    /// router probability, computed per MoE layer over its micro-batch and averaged over the MoE
    /// layers (Hugging Face computes it once over all layers' tokens together: equal when the
    /// layers route alike). Switch Transformer's and Megatron's form divides by `k`.
    pub router_aux_loss_coef: Option<f64>,
    /// Weight of the router z-loss (ST-MoE): the mean over tokens of `logsumexp(router logits)²`,
    /// averaged over the MoE layers; default 0 (off; ST-MoE used 0.001).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_z_loss_coef: Option<f64>,
    /// Renormalise the top-k routing weights to sum to 1 (Mixtral always does); default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_topk_prob: Option<bool>,
    /// Width of each expert's SwiGLU; default `intermediate_size` (which dense layers keep).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_intermediate_size: Option<usize>,
    /// Layers that keep a dense MLP in a mixture-of-experts model (e.g. `[0]` for a first dense
    /// layer, as DeepSeek's first-k-dense).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mlp_only_layers: Vec<usize>,
    /// Auxiliary-loss-free load balancing (DeepSeek-V3; Megatron's
    /// `moe_router_bias_update_rate`): each MoE layer keeps a per-expert bias that is added to
    /// the router probabilities when the top-k experts are chosen (not to the routing weights),
    /// and after every step moves by this rate towards balance:
    /// `bᵢ += rate · sign(mean load − loadᵢ)`, loads counted over the whole job's step. Default
    /// 0 (off); DeepSeek-V3 used 0.001. Combine with a small or zero `router_aux_loss_coef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_bias_update_rate: Option<f64>,
    /// Expert capacity in training (Megatron's `moe_expert_capacity_factor`): each expert takes
    /// at most `ceil(factor · n · k / E)` of the `n` tokens a rank routes per micro-batch, keeping
    /// those with the highest routing probability; a dropped (token, slot) pair contributes
    /// nothing. Absent: dropless (Mixtral). Evaluation and exports are always dropless.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_expert_capacity_factor: Option<f64>,
    /// Which pairs an expert over its capacity keeps, and how (see [`CapacityPolicy`]; default
    /// `probs`). A capacity setting: needs `moe_expert_capacity_factor`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_capacity_policy: Option<CapacityPolicy>,
}

/// One token id or several (Llama 3 lists three end-of-sequence ids).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// A single id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids as a list.
    pub fn ids(&self) -> Vec<u32> {
        match self {
            TokenIds::One(i) => vec![*i],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// Rescaling of the rotary embedding's inverse frequencies, as Hugging Face's `rope_type`s of the
/// same names. Attention is not rescaled by either (their attention factor is 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase", deny_unknown_fields)]
pub enum RopeScaling {
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        /// Context extension factor.
        factor: f64,
    },
    /// Llama 3.1's rescaling: wavelengths longer than `original / low_freq_factor` are divided by
    /// `factor`, shorter than `original / high_freq_factor` kept, and those between interpolated.
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f64,
        /// Wavelength bound (as a fraction of the original context) above which frequencies scale.
        low_freq_factor: f64,
        /// Wavelength bound below which frequencies are kept.
        high_freq_factor: f64,
        /// Context length the model was first trained at.
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// Hugging Face's name for this type (`rope_type`).
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
        }
    }

    fn validate(&self) -> Result<(), String> {
        let positive = |field: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("model.rope_scaling.{field} ({v}) must be positive"))
            }
        };
        match *self {
            RopeScaling::Linear { factor } => positive("factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(format!(
                        "model.rope_scaling.high_freq_factor ({high_freq_factor}) must exceed low_freq_factor ({low_freq_factor})"
                    ));
                }
                if original_max_position_embeddings == 0 {
                    return Err(
                        "model.rope_scaling.original_max_position_embeddings must be positive"
                            .to_string(),
                    );
                }
                Ok(())
            }
        }
    }
}

fn default_rope_theta() -> f64 {
    10000.0
}
fn default_rms_norm_eps() -> f64 {
    1e-5
}
fn default_init_std() -> f64 {
    0.02
}

impl LlamaConfig {
    /// Dimension of one attention head: `head_dim` if set, else `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Output width of the query projection (input width of `o_proj`): heads × head dimension.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim()
    }

    /// Inverse rotary frequencies `[head_dim / 2]` in f64: `θ^(−2i/d)`, rescaled by `rope_scaling`.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim() as f64;
        let plain = (0..self.head_dim() / 2).map(|i| self.rope_theta.powf(-(2.0 * i as f64) / d));
        match self.rope_scaling {
            None => plain.collect(),
            Some(RopeScaling::Linear { factor }) => plain.map(|f| f / factor).collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            }) => plain
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let (long, short) = (original as f64 / low, original as f64 / high);
                    if wavelen > long {
                        f / factor
                    } else if wavelen < short {
                        f
                    } else {
                        let smooth = (original as f64 / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect(),
        }
    }

    /// Checks the config's internal consistency; each message names the offending field.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(format!("model.{field} must be positive"));
            }
        }
        if self.max_position_embeddings > MAX_POSITIONS {
            return Err(format!(
                "model.max_position_embeddings ({}) exceeds {MAX_POSITIONS}",
                self.max_position_embeddings
            ));
        }
        let params = self.num_params_f64();
        if params > MAX_PARAMS {
            return Err(format!(
                "the model would have {params:.3e} parameters, more than {MAX_PARAMS:.0e}: check \
                 model.vocab_size ({}), model.hidden_size ({}), model.intermediate_size ({}) and \
                 model.num_hidden_layers ({})",
                self.vocab_size, self.hidden_size, self.intermediate_size, self.num_hidden_layers
            ));
        }
        if self.num_hidden_layers > MAX_LAYERS {
            return Err(format!(
                "model.num_hidden_layers ({}) exceeds {MAX_LAYERS}",
                self.num_hidden_layers
            ));
        }
        if self.head_dim == Some(0) {
            return Err("model.head_dim must be positive".to_string());
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "model.hidden_size ({}) must be divisible by model.num_attention_heads ({}), or set model.head_dim",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "model.num_attention_heads ({}) must be divisible by model.num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "the head dimension ({}) must be even for rotary embeddings",
                self.head_dim()
            ));
        }
        if let Some(r) = &self.rope_scaling {
            r.validate()?;
        }
        for (field, id) in [("bos_token_id", self.bos_token_id.map(|i| vec![i]))]
            .into_iter()
            .chain([(
                "eos_token_id",
                self.eos_token_id.as_ref().map(TokenIds::ids),
            )])
        {
            if let Some(bad) = id
                .into_iter()
                .flatten()
                .find(|&i| i as usize >= self.vocab_size)
            {
                return Err(format!(
                    "model.{field} ({bad}) must be below model.vocab_size ({})",
                    self.vocab_size
                ));
            }
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return Err(format!(
                "model.rope_theta ({}) must be positive",
                self.rope_theta
            ));
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(format!(
                "model.rms_norm_eps ({}) must be positive",
                self.rms_norm_eps
            ));
        }
        if self.init_std.is_nan() || self.init_std <= 0.0 {
            return Err(format!(
                "model.init_std ({}) must be positive",
                self.init_std
            ));
        }
        self.validate_moe()
    }

    /// Parameters in floating point, which cannot overflow (for bounds checks on untrusted
    /// sizes): all of them, or with `active` only those one token uses (`k` of each MoE layer's
    /// experts; the router counts as active).
    fn count_params(&self, active: bool) -> f64 {
        let (h, f, v) = (
            self.hidden_size as f64,
            self.intermediate_size as f64,
            self.vocab_size as f64,
        );
        let d = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1)) as f64;
        let (kv, q) = (
            self.num_key_value_heads as f64 * d,
            self.num_attention_heads as f64 * d,
        );
        let attention = 2.0 * h + 2.0 * h * q + 2.0 * h * kv;
        let dense_mlp = 3.0 * h * f;
        let mlp = match self.moe() {
            Some(m) => {
                let experts = if active { m.top_k } else { m.num_experts };
                let moe =
                    m.num_experts as f64 * h + experts as f64 * 3.0 * h * m.expert_size as f64;
                let n_moe = self.num_moe_layers() as f64;
                n_moe * moe + (self.num_hidden_layers as f64 - n_moe) * dense_mlp
            }
            None => self.num_hidden_layers as f64 * dense_mlp,
        };
        let head = if self.tie_word_embeddings { 0.0 } else { v * h };
        v * h + self.num_hidden_layers as f64 * attention + mlp + h + head
    }

    /// [`LlamaConfig::num_params`] in floating point, which cannot overflow (for bounds checks
    /// on untrusted sizes).
    pub fn num_params_f64(&self) -> f64 {
        self.count_params(false)
    }

    /// Number of parameters (embedding counted once when tied; every expert counted). Exact for
    /// a validated config (at most 10¹³ < 2⁵³).
    pub fn num_params(&self) -> usize {
        self.count_params(false) as usize
    }

    /// Parameters one token uses: [`LlamaConfig::num_params`] with `num_experts_per_tok` of each
    /// MoE layer's experts instead of all of them (equal for a dense model).
    pub fn num_active_params(&self) -> usize {
        self.count_params(true) as usize
    }

    /// Training FLOPs per token: `6 N + 6 L s q` where `N` counts the matrices a token uses
    /// (embedding lookup excluded, output projection included, `k` experts and the router of a
    /// MoE layer), `q` is heads × head dimension, and `6 L s q` is the causal attention's `QKᵀ`
    /// and `PV` (forward `2·2·s·q/2` per layer with the causal half, ×3 for backward).
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        let (h, v) = (self.hidden_size as f64, self.vocab_size as f64);
        let matrices = self.num_active_params() as f64
            - v * h * if self.tie_word_embeddings { 0.0 } else { 1.0 }
            - (2 * self.num_hidden_layers + 1) as f64 * h;
        6.0 * matrices + self.attention_flops_per_token(seq_len)
    }

    /// The attention part of [`LlamaConfig::flops_per_token`], `6 L s q`, for the plain causal
    /// mask; with documents kept apart the work done is this times the share of the causal
    /// (query, key) pairs the document mask keeps.
    pub fn attention_flops_per_token(&self, seq_len: usize) -> f64 {
        6.0 * self.num_hidden_layers as f64 * seq_len as f64 * self.q_dim() as f64
    }
}

#[cfg(test)]
mod tests;
