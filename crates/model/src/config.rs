//! `LlamaConfig`: the `model:` section of a recipe, named as in Hugging Face's `LlamaConfig`.

use serde::{Deserialize, Serialize};

/// Shape and numerics of a Llama decoder. Field names follow Hugging Face's `config.json`, so an
/// exported `config.json` is this struct plus a few fixed keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Query heads; `hidden_size / num_attention_heads` is the head dimension.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); must divide `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Base of the rotary embedding frequencies.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
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
    /// Dimension of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
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
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "model.hidden_size ({}) must be divisible by model.num_attention_heads ({})",
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
                "model.hidden_size / model.num_attention_heads = {} must be even for rotary embeddings",
                self.head_dim()
            ));
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
        Ok(())
    }

    /// Every parameter of the whole model in Hugging Face naming, with its shape, in model order.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let kv = self.num_key_value_heads * self.head_dim();
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        for i in 0..self.num_hidden_layers {
            let n = |s: &str| format!("model.layers.{i}.{s}.weight");
            out.extend([
                (n("input_layernorm"), vec![h]),
                (n("self_attn.q_proj"), vec![h, h]),
                (n("self_attn.k_proj"), vec![kv, h]),
                (n("self_attn.v_proj"), vec![kv, h]),
                (n("self_attn.o_proj"), vec![h, h]),
                (n("post_attention_layernorm"), vec![h]),
                (n("mlp.gate_proj"), vec![f, h]),
                (n("mlp.up_proj"), vec![f, h]),
                (n("mlp.down_proj"), vec![h, f]),
            ]);
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![v, h]));
        }
        out
    }

    /// Number of parameters (embedding counted once when tied).
    pub fn num_params(&self) -> usize {
        let (h, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let kv = self.num_key_value_heads * self.head_dim();
        let per_layer = 2 * h + h * h * 2 + 2 * h * kv + 3 * h * f;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * per_layer + h + head
    }

    /// Training FLOPs per token: `6 N + 6 L s h` where `N` counts the matrices (embedding lookup
    /// excluded, output projection included), and `6 L s h` is the causal attention's
    /// `QKᵀ` and `PV` (forward `2·2·s·h/2` per layer with the causal half, ×3 for backward).
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        let (h, v) = (self.hidden_size as f64, self.vocab_size as f64);
        let matrices = self.num_params() as f64
            - v * h * if self.tie_word_embeddings { 0.0 } else { 1.0 }
            - (2 * self.num_hidden_layers + 1) as f64 * h;
        let attention = 6.0 * self.num_hidden_layers as f64 * seq_len as f64 * h;
        6.0 * matrices + attention
    }
}
