//! Hugging Face interchange: `export-hf` writes a `LlamaForCausalLM` directory (safetensors
//! weights, sharded above a size threshold, `config.json`, `generation_config.json`, tokenizer
//! files) from a checkpoint, streaming tensor by tensor, then re-loads the exported files and checks
//! their logits against the checkpoint's (the parity gate). `import-hf` turns such a directory into
//! a step-0 checkpoint that training resumes from at any layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use ckpt::stream::{write_streaming, TensorSpec};
use ckpt::{Checkpoint, Kind, Manifest, RankWriter, TensorBlock};
use half::bf16;
use model::{Llama, LlamaConfig, Placement, TokenIds};
use serde_json::{json, Value};

use crate::recipe::{load_stored, Dtype, Recipe};
use crate::train::checkpoint::tensor_block;

pub mod config;
pub mod output;
mod parity;
mod rope;
pub mod weights;

pub use weights::HfWeights;

/// Largest safetensors file `export-hf` writes before sharding (bytes), as Hugging Face's default.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The recipe stored in a checkpoint.
pub fn checkpoint_recipe(ck: &Checkpoint, overrides: &[String]) -> Result<Recipe> {
    Ok(load_stored(
        &ck.manifest().recipe,
        &ck.dir().join(ckpt::MANIFEST),
        overrides,
    )?)
}

/// A whole single-rank f32 model with the checkpoint's master weights.
pub fn model_from_checkpoint(ck: &Checkpoint, config: &LlamaConfig) -> Result<Llama> {
    let m = Llama::new(
        config,
        Placement::whole(config),
        0,
        DType::F32,
        &Device::Cpu,
    )?;
    m.load_weights(|p| -> Result<Vec<f32>> { Ok(ck.read_block(Kind::Master, tensor_block(p))?) })?;
    Ok(m)
}

/// What `export-hf` wrote.
#[derive(Debug, Clone)]
pub struct ExportSummary {
    /// Weight files written.
    pub files: Vec<String>,
    /// Bytes of weights.
    pub bytes: u64,
    /// Largest relative logit difference found by the parity gate.
    pub parity: f64,
}

/// Values in `dtype`'s bytes; a non-finite value is an error naming its position.
fn to_bytes(v: &[f32], dtype: Dtype) -> std::result::Result<Vec<u8>, String> {
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(format!(
            "non-finite value {} at element {i}; refusing to export it",
            v[i]
        ));
    }
    Ok(match dtype {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::Bf16 => v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect(),
    })
}

/// How `export-hf` writes.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Weight dtype (default: the training dtype).
    pub dtype: Option<Dtype>,
    /// Largest weight file in bytes before sharding.
    pub max_shard_bytes: u64,
    /// Replace an earlier export in the output directory (once the new one has passed).
    pub overwrite: bool,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self {
            dtype: None,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            overwrite: false,
        }
    }
}

/// Exports the checkpoint `dir` to `out`, staged ([`output`]): on any failure, the parity gate's
/// included, `out` keeps what it held, an earlier export too; it never holds an export that did
/// not pass.
pub fn export(dir: &Path, out: &Path, opts: &ExportOptions) -> Result<ExportSummary> {
    let ck = Checkpoint::open(dir)?;
    let recipe = checkpoint_recipe(&ck, &[])?;
    let (c, dtype) = (&recipe.model, opts.dtype.unwrap_or(recipe.train.dtype));
    let output = output::Output::prepare(out, opts.overwrite)?;
    let stage = output.staging();
    let written = write_export(&ck, c, stage, dtype, opts.max_shard_bytes)
        .and_then(|(files, bytes)| Ok((parity::gate(&ck, c, stage, dtype)?, files, bytes)));
    match written {
        Ok((parity, files, bytes)) => {
            output.commit()?;
            Ok(ExportSummary {
                files,
                bytes,
                parity,
            })
        }
        Err(e) => {
            output.abandon();
            Err(e.context(format!("exporting to {}", out.display())))
        }
    }
}

/// Writes the weights (sharded greedily in model order), `config.json`, the generation config and
/// the tokenizer files; returns the weight files and their bytes.
fn write_export(
    ck: &Checkpoint,
    c: &LlamaConfig,
    out: &Path,
    dtype: Dtype,
    max_shard_bytes: u64,
) -> Result<(Vec<String>, u64)> {
    let code = match dtype {
        Dtype::F32 => "F32",
        Dtype::Bf16 => "BF16",
    };
    let specs: Vec<TensorSpec> = c
        .tensor_shapes()
        .into_iter()
        .map(|(name, shape)| TensorSpec {
            name,
            dtype: code,
            shape,
        })
        .collect();
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut size = 0u64;
    for (i, s) in specs.iter().enumerate() {
        if size > 0 && size + s.nbytes() as u64 > max_shard_bytes {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().expect("one shard at least").push(i);
        size += s.nbytes() as u64;
    }
    let n = shards.len();
    let name_of = |k: usize| {
        if n == 1 {
            weights::SINGLE.to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
        }
    };
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let (mut bytes, mut weight_map) = (0u64, serde_json::Map::new());
    for (k, idx) in shards.iter().enumerate() {
        let file = name_of(k);
        let part: Vec<TensorSpec> = idx.iter().map(|&i| specs[i].clone()).collect();
        bytes += write_streaming(&out.join(&file), &part, &meta, |j| {
            let s = &part[j];
            let v = ck.read_tensor(&s.name, Kind::Master, &s.shape)?;
            to_bytes(&v, dtype).map_err(|e| ckpt::CkptError::Mismatch {
                dir: ck.dir().to_path_buf(),
                message: format!("{}: {e}", s.name),
            })
        })?;
        for s in &part {
            weight_map.insert(s.name.clone(), json!(file));
        }
    }
    if n > 1 {
        let index = json!({ "metadata": { "total_size": bytes }, "weight_map": weight_map });
        std::fs::write(out.join(weights::INDEX), serde_json::to_vec_pretty(&index)?)?;
    }
    let tokenizer = data::load_tokenizer(ck.tokenizer_path())?;
    let eod = data::eod_id(
        &tokenizer,
        &ck.tokenizer_path(),
        "the exported config's eos_token_id",
    )?;
    let bos = c
        .bos_token_id
        .or_else(|| data::bos_id(&tokenizer, &ck.tokenizer_path()).ok())
        .unwrap_or(eod);
    let eos = c.eos_token_id.clone().unwrap_or(TokenIds::One(eod));
    std::fs::write(
        out.join("config.json"),
        serde_json::to_vec_pretty(&config::write(c, dtype, bos, &eos)?)?,
    )?;
    let generation =
        json!({ "_from_model_config": true, "bos_token_id": bos, "eos_token_id": eos });
    std::fs::write(
        out.join("generation_config.json"),
        serde_json::to_vec_pretty(&generation)?,
    )?;
    let (src, dst) = (ck.tokenizer_path(), out.join("tokenizer.json"));
    let tokenizer_bytes =
        std::fs::read(&src).with_context(|| format!("reading {}", src.display()))?;
    std::fs::write(&dst, tokenizer_bytes).with_context(|| format!("writing {}", dst.display()))?;
    let token = |id: u32| {
        tokenizer
            .id_to_token(id)
            .unwrap_or_else(|| data::EOD_TOKEN.to_string())
    };
    let tok_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(bos),
        "eos_token": token(eos.ids()[0]),
        "model_max_length": c.max_position_embeddings,
        "clean_up_tokenization_spaces": false,
    });
    std::fs::write(
        out.join("tokenizer_config.json"),
        serde_json::to_vec_pretty(&tok_config)?,
    )?;
    Ok(((0..n).map(name_of).collect(), bytes))
}

/// Whether two JSON values are equal, numbers within 1e-12 relative (a decimal round trip).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (
                x.as_f64().unwrap_or(f64::NAN),
                y.as_f64().unwrap_or(f64::NAN),
            );
            (x - y).abs() <= 1e-12 * y.abs().max(1.0)
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(v, w)| same(v, w))
        }
        _ => a == b,
    }
}

/// The differences between the Hugging Face model and the recipe's, one line per key.
fn differences(theirs: &LlamaConfig, ours: &LlamaConfig, cfg: &Path) -> Vec<String> {
    let pairs = |c: &LlamaConfig| {
        [
            ("vocab_size", json!(c.vocab_size)),
            ("hidden_size", json!(c.hidden_size)),
            ("intermediate_size", json!(c.intermediate_size)),
            ("num_hidden_layers", json!(c.num_hidden_layers)),
            ("num_attention_heads", json!(c.num_attention_heads)),
            ("num_key_value_heads", json!(c.num_key_value_heads)),
            ("head_dim", json!(c.head_dim())),
            ("max_position_embeddings", json!(c.max_position_embeddings)),
            ("rope_theta", json!(c.rope_theta)),
            ("rope_scaling", json!(c.rope_scaling)),
            ("rms_norm_eps", json!(c.rms_norm_eps)),
            ("tie_word_embeddings", json!(c.tie_word_embeddings)),
            ("bos_token_id", json!(c.bos_token_id)),
            ("eos_token_id", json!(c.eos_token_id)),
            ("num_local_experts", json!(c.num_local_experts)),
            ("num_experts_per_tok", json!(c.moe().map(|m| m.top_k))),
            ("norm_topk_prob", json!(c.moe().map(|m| m.norm_topk_prob))),
            (
                "moe_intermediate_size",
                json!(c.moe().map(|m| m.expert_size)),
            ),
            ("mlp_only_layers", json!(c.mlp_only_layers)),
        ]
    };
    pairs(theirs)
        .into_iter()
        .zip(pairs(ours))
        // Token ids the recipe leaves unset are taken from config.json.
        .filter(|((k, _), (_, o))| !(k.ends_with("token_id") && o.is_null()))
        .filter(|((_, t), (_, o))| !same(t, o))
        .map(|((k, t), (_, o))| {
            if unset(cfg, k) {
                format!(
                    "{k}: {} leaves it unset (transformers' default {t}), recipe model.{k} is {o}",
                    cfg.display()
                )
            } else {
                format!("{k}: {} has {t}, recipe model.{k} is {o}", cfg.display())
            }
        })
        .collect()
}

/// Whether `config.json` at `cfg` leaves the plain size key `k` out (its value is then
/// transformers' default, not the file's).
fn unset(cfg: &Path, k: &str) -> bool {
    const PLAIN: [&str; 7] = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
        "rms_norm_eps",
    ];
    let read = || -> Option<Value> { serde_json::from_slice(&std::fs::read(cfg).ok()?).ok() };
    PLAIN.contains(&k)
        && read().is_some_and(|v| {
            v.get(k).is_none() && v.get("text_config").and_then(|t| t.get(k)).is_none()
        })
}

/// Imports the Hugging Face Llama directory `model_dir` as a step-0 checkpoint of `recipe` under
/// `root` (fp32 masters from the weights, zero moments). The recipe's model must be the one
/// `config.json` describes; token ids it leaves unset are taken from there. Returns the step
/// directory.
pub fn import(model_dir: &Path, recipe: &Recipe, root: &Path) -> Result<PathBuf> {
    // A root with checkpoints belongs to a run: importing there would point `latest` at step 0
    // and the run's next `resume: auto` would restart from the import over its own steps.
    if let Some(existing) = ckpt::checkpoint_entry(root) {
        bail!(
            "{} already holds checkpoints ({existing}); import into a fresh directory \
             (--output DIR)",
            root.display()
        );
    }
    let cfg_path = model_dir.join("config.json");
    let hf = config::read(&cfg_path)?;
    let diff = differences(&hf.config, &recipe.model, &cfg_path);
    if !diff.is_empty() {
        bail!(
            "the Hugging Face model does not match the recipe:\n  {}",
            diff.join("\n  ")
        );
    }
    let mut recipe = recipe.clone();
    let c = &mut recipe.model;
    c.bos_token_id = c.bos_token_id.or(hf.config.bos_token_id);
    c.eos_token_id = c.eos_token_id.clone().or(hf.config.eos_token_id);
    let c = &recipe.model;
    let tokenizer = model_dir.join("tokenizer.json");
    let tokenizer = if tokenizer.exists() {
        // Compared without blocking on a FIFO or reading past a tokenizer's cap (either is
        // refused when the tokenizer is loaded below).
        let read = |p: &Path| crate::files::read_capped(p, data::MAX_TOKENIZER_BYTES).ok();
        let same = read(&tokenizer) == read(&recipe.data.tokenizer);
        if !same {
            tracing::warn!(
                "{} differs from the recipe's data.tokenizer {}: the checkpoint carries the \
                 model's, and a resume with the recipe's is refused (tokenize the data with the \
                 model's tokenizer and point data.tokenizer at it)",
                tokenizer.display(),
                recipe.data.tokenizer.display()
            );
        }
        tokenizer
    } else {
        tracing::warn!(
            "{} has no tokenizer.json: the checkpoint carries the recipe's data.tokenizer {}",
            model_dir.display(),
            recipe.data.tokenizer.display()
        );
        recipe.data.tokenizer.clone()
    };
    // The tokenizer the checkpoint carries is parsed now, not when an export or an evaluation
    // first needs it, and its ids must fit the model's vocabulary.
    let vocab = data::load_tokenizer(&tokenizer)?.get_vocab_size(true);
    if vocab > c.vocab_size {
        bail!(
            "{}: the tokenizer has {vocab} tokens, more than the model's vocab_size {}",
            tokenizer.display(),
            c.vocab_size
        );
    }
    let weights = HfWeights::open(model_dir)?;
    let shapes = c.tensor_shapes();
    for name in weights.names() {
        // A tied model's lm_head, when stored, is ignored as transformers ignores it.
        let known = shapes.iter().any(|(n, _)| n == name)
            || name.ends_with("rotary_emb.inv_freq")
            || (c.tie_word_embeddings && name == "lm_head.weight");
        if !known {
            bail!(
                "{}: unexpected tensor {name} for this model",
                model_dir.display()
            );
        }
    }
    let mut writer = RankWriter::new(root, 0, 0)?;
    for (name, shape) in &shapes {
        let v = weights.get(name, shape)?;
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            bail!(
                "{}: {name} holds a non-finite value ({} at element {i})",
                model_dir.display(),
                v[i]
            );
        }
        let offset = vec![0; shape.len()];
        let whole = TensorBlock {
            name,
            global_shape: shape,
            offset: &offset,
            shape,
        };
        let n = v.len();
        writer.add(Kind::Master, whole, 0..n, v);
        writer.add(Kind::ExpAvg, whole, 0..n, vec![0.0; n]);
        writer.add(Kind::ExpAvgSq, whole, 0..n, vec![0.0; n]);
    }
    writer.write()?;
    let manifest = Manifest {
        format: String::new(),
        step: 0,
        consumed_samples: 0,
        seed: recipe.train.seed,
        model: serde_json::to_value(c)?,
        recipe: serde_yaml::to_string(&recipe)?,
        layout: serde_json::to_value(parallel::ParallelConfig::default())?,
        trainer: serde_json::Value::Null,
        files: vec![],
        pieces: vec![],
        tokenizer: None,
        datasets: vec![],
    };
    Ok(ckpt::finalize(
        root,
        manifest,
        1,
        &tokenizer,
        recipe.checkpoint.keep.max(1),
    )?)
}
