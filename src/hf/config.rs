//! `config.json` of a Hugging Face Llama, read as transformers 4 and 5 read it and written so that
//! both load the same model.
//!
//! RoPE comes in two forms: transformers 4 writes a top-level `rope_theta` and a `rope_scaling`
//! dictionary (or null); transformers 5 writes one `rope_parameters` dictionary holding
//! `rope_type`, `rope_theta` and the scaling parameters. Either form is read; when a file carries
//! both and they describe different RoPE, the import stops instead of choosing one. Everything this
//! model does not implement (another `model_type`, biases, sliding windows, qk-norm, partial
//! rotary, inference-only RoPE types) is refused by name rather than imported as a plain Llama.

use std::path::Path;

use anyhow::{bail, Context, Result};
use model::{LlamaConfig, TokenIds};
use serde_json::{json, Value};

use super::rope::{rope, scaling_dict};
use crate::recipe::Dtype;

/// Base of the rotary frequencies when a config names none (transformers' default).
pub(super) const DEFAULT_THETA: f64 = 10000.0;

/// The model a `config.json` describes.
#[derive(Debug, Clone)]
pub struct HfModel {
    /// The architecture in this project's terms (`init_std` from `initializer_range`; `head_dim`
    /// only when it differs from `hidden_size / num_attention_heads`).
    pub config: LlamaConfig,
    /// Storage dtype named by `dtype` (transformers 5) or `torch_dtype` (transformers 4).
    pub dtype: Option<String>,
}

/// A key's value, absent and `null` alike being `None`.
pub(super) fn key<'a>(v: &'a Value, k: &str) -> Option<&'a Value> {
    v.get(k).filter(|x| !x.is_null())
}

/// Largest `config.json` read (a Llama or Mixtral config is a few kilobytes).
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// Reads and checks the `config.json` at `path` (a regular file of at most
/// [`MAX_CONFIG_BYTES`]).
pub fn read(path: &Path) -> Result<HfModel> {
    let bytes = crate::files::read_capped(path, MAX_CONFIG_BYTES)
        .with_context(|| format!("reading {}", path.display()))?;
    let v: Value =
        serde_json::from_slice(&bytes).with_context(|| format!("{}: not JSON", path.display()))?;
    parse(&v).with_context(|| path.display().to_string())
}

fn parse(v: &Value) -> Result<HfModel> {
    if !v.is_object() {
        bail!("not a JSON object");
    }
    let mixtral = check_architecture(v)?;
    let uint = |k: &str, default: usize| -> Result<usize> {
        match key(v, k) {
            None => Ok(default),
            Some(x) => x
                .as_u64()
                .map(|n| n as usize)
                .with_context(|| format!("{k}: expected a non-negative integer, found {x}")),
        }
    };
    let float = |k: &str, default: f64| -> Result<f64> {
        match key(v, k) {
            None => Ok(default),
            Some(x) => x
                .as_f64()
                .with_context(|| format!("{k}: expected a number, found {x}")),
        }
    };
    let flag = |k: &str| -> Result<bool> {
        match key(v, k) {
            None => Ok(false),
            Some(x) => x
                .as_bool()
                .with_context(|| format!("{k}: expected true or false, found {x}")),
        }
    };
    for k in ["attention_bias", "mlp_bias", "use_sliding_window"] {
        if flag(k)? {
            bail!("{k}: true is not supported by this Llama (no biases, full attention only)");
        }
    }
    for k in ["qk_norm", "use_qk_norm", "qk_layernorm", "use_qk_layernorm"] {
        if key(v, k).is_some_and(|x| x != &json!(false)) {
            bail!("{k}: query/key normalisation is not supported by this Llama");
        }
    }
    if let Some(w) = key(v, "sliding_window") {
        bail!("sliding_window: {w} is not supported (this Llama attends to the whole context)");
    }
    if let Some(a) = key(v, "hidden_act").filter(|a| a.as_str() != Some("silu")) {
        bail!("hidden_act: {a} is not supported; this Llama uses silu (SwiGLU)");
    }
    if float("attention_dropout", 0.0)? != 0.0 {
        bail!(
            "attention_dropout: {} is not supported; this Llama trains without dropout",
            v["attention_dropout"]
        );
    }
    if let Some(p) = key(v, "partial_rotary_factor").filter(|p| p.as_f64() != Some(1.0)) {
        bail!(
            "partial_rotary_factor: {p} is not supported; rotary embeddings cover the whole head"
        );
    }

    let (hidden, heads) = (uint("hidden_size", 4096)?, uint("num_attention_heads", 32)?);
    let head_dim = uint("head_dim", 0)?;
    let mut config = LlamaConfig {
        vocab_size: uint("vocab_size", 32000)?,
        hidden_size: hidden,
        intermediate_size: uint("intermediate_size", 11008)?,
        num_hidden_layers: uint("num_hidden_layers", 32)?,
        num_attention_heads: heads,
        num_key_value_heads: uint("num_key_value_heads", heads)?,
        head_dim: (head_dim != 0 && heads != 0 && head_dim * heads != hidden).then_some(head_dim),
        rope_theta: DEFAULT_THETA,
        rope_scaling: None,
        rms_norm_eps: float("rms_norm_eps", 1e-6)?,
        tie_word_embeddings: flag("tie_word_embeddings")?,
        max_position_embeddings: uint("max_position_embeddings", 2048)?,
        init_std: float("initializer_range", 0.02)?,
        bos_token_id: match key(v, "bos_token_id") {
            None => None,
            Some(x) => Some(token_id(x).context("bos_token_id")?),
        },
        eos_token_id: match key(v, "eos_token_id") {
            None => None,
            Some(Value::Array(a)) => Some(TokenIds::Many(
                a.iter()
                    .map(token_id)
                    .collect::<Result<_>>()
                    .context("eos_token_id")?,
            )),
            Some(x) => Some(TokenIds::One(token_id(x).context("eos_token_id")?)),
        },
        ..Default::default()
    };
    if mixtral {
        // Mixtral: every layer a sparse MoE block, softmax top-k routing renormalised.
        if float("router_jitter_noise", 0.0)? != 0.0 {
            bail!(
                "router_jitter_noise: {} is not supported (routing without noise only)",
                v["router_jitter_noise"]
            );
        }
        config.num_local_experts = Some(uint("num_local_experts", 8)?);
        config.num_experts_per_tok = Some(uint("num_experts_per_tok", 2)?);
        config.router_aux_loss_coef = Some(float("router_aux_loss_coef", 0.001)?);
    }
    (config.rope_theta, config.rope_scaling) = rope(v, config.max_position_embeddings)?;
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("{}", e.replace("model.", "")))?;
    let dtype = match (key(v, "dtype"), key(v, "torch_dtype")) {
        (Some(a), Some(b)) if a != b => bail!("dtype ({a}) and torch_dtype ({b}) disagree"),
        (Some(a), _) | (None, Some(a)) => Some(
            a.as_str()
                .with_context(|| format!("dtype: expected a name such as \"bfloat16\", found {a}"))?
                .to_string(),
        ),
        (None, None) => None,
    };
    Ok(HfModel { config, dtype })
}

fn token_id(x: &Value) -> Result<u32> {
    x.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .with_context(|| format!("expected a token id, found {x}"))
}

/// `model_type` must be `llama` or `mixtral` and `architectures`, when given, the matching
/// `LlamaForCausalLM` or `MixtralForCausalLM` only. Returns whether it is Mixtral.
fn check_architecture(v: &Value) -> Result<bool> {
    if let Some(q) = key(v, "quantization_config") {
        let method = q
            .get("quant_method")
            .and_then(|m| m.as_str())
            .unwrap_or("?");
        bail!(
            "quantization_config: the weights are quantized ({method}); only full-precision \
             weights (float32, bfloat16, float16) import"
        );
    }
    let archs: Vec<&str> = match key(v, "architectures") {
        None => vec![],
        Some(a) => a
            .as_array()
            .with_context(|| format!("architectures: expected a list, found {a}"))?
            .iter()
            .map(|x| x.as_str().unwrap_or("?"))
            .collect(),
    };
    let kind = match key(v, "model_type") {
        Some(t) => match t.as_str() {
            Some(k @ ("llama" | "mixtral")) => k,
            _ => bail!(
                "model_type: {t} is not supported; only Llama (\"llama\", LlamaForCausalLM) and \
                 Mixtral (\"mixtral\", MixtralForCausalLM) import"
            ),
        },
        None if archs.is_empty() => bail!(
            "names neither model_type nor architectures; only Llama (\"llama\") and Mixtral \
             (\"mixtral\") import"
        ),
        None if archs.iter().all(|a| *a == "MixtralForCausalLM") => "mixtral",
        None => "llama",
    };
    let want = if kind == "mixtral" {
        "MixtralForCausalLM"
    } else {
        "LlamaForCausalLM"
    };
    if let Some(a) = archs.iter().find(|a| **a != want) {
        bail!(
            "architectures: {a} is not supported with model_type \"{kind}\"; only {want} imports"
        );
    }
    Ok(kind == "mixtral")
}

/// `config.json` for `c` stored in `dtype`, readable by transformers 4 (`rope_theta`,
/// `rope_scaling`, `torch_dtype`) and 5 (`rope_parameters`, `dtype`) alike: a Llama, or a
/// Mixtral for a mixture-of-experts model. A MoE model Mixtral cannot express (dense layers
/// among the MoE ones, top-k weights not renormalised) is refused by name; no other
/// transformers architecture computes it either (Qwen2-MoE adds a shared expert and attention
/// biases, Qwen3-MoE normalises queries and keys).
pub fn write(c: &LlamaConfig, dtype: Dtype, bos: u32, eos: &TokenIds) -> Result<Value> {
    let mut parameters = scaling_dict(c.rope_scaling.as_ref());
    parameters.insert("rope_theta".to_string(), json!(c.rope_theta));
    let rope_scaling = c
        .rope_scaling
        .as_ref()
        .map_or(Value::Null, |s| Value::Object(scaling_dict(Some(s))));
    let dtype = match dtype {
        Dtype::F32 => "float32",
        Dtype::Bf16 => "bfloat16",
    };
    let mut v = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim(),
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": parameters,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "pretraining_tp": 1,
        "tie_word_embeddings": c.tie_word_embeddings,
        "vocab_size": c.vocab_size,
        "initializer_range": c.init_std,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "use_cache": true,
        "torch_dtype": dtype,
        "dtype": dtype,
    });
    if let Some(m) = c.moe() {
        if !m.dense_layers.is_empty() {
            bail!(
                "model.mlp_only_layers ({:?}): Mixtral has a MoE block in every layer, and no \
                 transformers architecture matches this model; export needs every layer MoE",
                m.dense_layers
            );
        }
        if m.bias_update_rate > 0.0 {
            bail!(
                "model.router_bias_update_rate ({}): the model chooses experts with trained \
                 per-expert biases, which Mixtral cannot hold, and no transformers architecture \
                 matches this model",
                m.bias_update_rate
            );
        }
        if !m.norm_topk_prob {
            bail!(
                "model.norm_topk_prob is false: Mixtral always renormalises the top-k routing \
                 weights, and no transformers architecture matches this model"
            );
        }
        let mixtral = json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "intermediate_size": m.expert_size,
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "router_aux_loss_coef": m.aux_loss_coef,
            "router_jitter_noise": 0.0,
            "output_router_logits": false,
            "sliding_window": null,
        });
        for (k, x) in mixtral.as_object().into_iter().flatten() {
            v[k] = x.clone();
        }
        if let Some(o) = v.as_object_mut() {
            for k in ["attention_bias", "mlp_bias", "pretraining_tp"] {
                o.remove(k);
            }
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests;
