//! RoPE in a Hugging Face `config.json`: transformers 4's top-level `rope_theta` and
//! `rope_scaling` dictionary, transformers 5's `rope_parameters` dictionary, read into this
//! model's base and scaling (refusing RoPE types it does not implement, and two forms that
//! disagree), and the scaling dictionary written for both.

use anyhow::{bail, Context, Result};
use model::RopeScaling;
use serde_json::{json, Map, Value};

use super::config::{key, DEFAULT_THETA};

/// RoPE base and scaling from the transformers-4 keys, the transformers-5 `rope_parameters`, or
/// both (which must agree).
pub(super) fn rope(v: &Value, max_pos: usize) -> Result<(f64, Option<RopeScaling>)> {
    let top_theta = match key(v, "rope_theta") {
        None => None,
        Some(x) => Some(
            x.as_f64()
                .with_context(|| format!("rope_theta: expected a number, found {x}"))?,
        ),
    };
    let v4 = (top_theta.is_some() || key(v, "rope_scaling").is_some()).then(|| -> Result<_> {
        let theta = top_theta.unwrap_or(DEFAULT_THETA);
        match key(v, "rope_scaling") {
            None => Ok((theta, None)),
            Some(d) => rope_dict(d, theta, max_pos).context("rope_scaling"),
        }
    });
    let v5 = key(v, "rope_parameters").map(|d| {
        rope_dict(d, top_theta.unwrap_or(DEFAULT_THETA), max_pos).context("rope_parameters")
    });
    match (v4.transpose()?, v5.transpose()?) {
        (Some(a), Some(b)) if a != b => bail!(
            "rope_parameters ({}) and rope_theta/rope_scaling ({}) describe different RoPE; \
             remove the stale one",
            describe(b),
            describe(a)
        ),
        (Some(r), _) | (None, Some(r)) => Ok(r),
        (None, None) => Ok((DEFAULT_THETA, None)),
    }
}

fn describe((theta, scaling): (f64, Option<RopeScaling>)) -> String {
    match scaling {
        None => format!("θ = {theta}, no scaling"),
        Some(s) => format!("θ = {theta}, {s:?}"),
    }
}

/// One RoPE dictionary (`rope_scaling` or `rope_parameters`); `theta` is used when it names none.
fn rope_dict(d: &Value, theta: f64, max_pos: usize) -> Result<(f64, Option<RopeScaling>)> {
    let m = d
        .as_object()
        .with_context(|| format!("expected a dictionary, found {d}"))?;
    if m.values().any(Value::is_object) {
        bail!("per-layer-type RoPE parameters are not supported");
    }
    let num = |k: &str| -> Result<Option<f64>> {
        match key(d, k) {
            None => Ok(None),
            Some(x) => {
                Ok(Some(x.as_f64().with_context(|| {
                    format!("{k}: expected a number, found {x}")
                })?))
            }
        }
    };
    let need = |k: &str| -> Result<f64> { num(k)?.with_context(|| format!("{k} is missing")) };
    let kind = key(d, "rope_type")
        .or_else(|| key(d, "type"))
        .map(|t| t.as_str().unwrap_or("?").to_string())
        .unwrap_or_else(|| "default".to_string());
    let allowed: &[&str] = match kind.as_str() {
        "default" => &[],
        "linear" => &["factor"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        other => bail!(
            "rope_type \"{other}\" is not supported (supported: default, linear, llama3; \
             dynamic, yarn and longrope are inference-time extensions)"
        ),
    };
    for k in m.keys() {
        let common = ["rope_type", "type", "rope_theta", "attention_factor"];
        if !common.contains(&k.as_str()) && !allowed.contains(&k.as_str()) {
            bail!("{k} is not a parameter of rope_type \"{kind}\"");
        }
    }
    if let Some(a) = num("attention_factor")?.filter(|a| *a != 1.0) {
        bail!("attention_factor {a} is not supported (attention is not rescaled)");
    }
    let theta = num("rope_theta")?.unwrap_or(theta);
    let scaling = match kind.as_str() {
        "linear" => Some(RopeScaling::Linear {
            factor: need("factor")?,
        }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: match num("original_max_position_embeddings")? {
                None => max_pos,
                Some(n) if n >= 1.0 && n.fract() == 0.0 => n as usize,
                Some(n) => bail!("original_max_position_embeddings: {n} is not a positive integer"),
            },
        }),
        _ => None,
    };
    Ok((theta, scaling))
}

/// The scaling parameters of `s` with their `rope_type` (a dictionary of both RoPE forms).
pub(super) fn scaling_dict(s: Option<&RopeScaling>) -> Map<String, Value> {
    match serde_json::to_value(s) {
        Ok(Value::Object(m)) => m,
        _ => Map::from_iter([("rope_type".to_string(), json!("default"))]),
    }
}
