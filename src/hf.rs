//! Hugging Face interchange: `export-hf` writes a `LlamaForCausalLM` directory (safetensors
//! weights, sharded above a size threshold, `config.json`, `generation_config.json`, tokenizer
//! files) from a checkpoint, streaming tensor by tensor, then re-loads the exported files and checks
//! their logits against the checkpoint's (the parity gate). `import-hf` turns such a directory into
//! a step-0 checkpoint that training resumes from at any layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use ckpt::stream::{write_streaming, TensorSpec};
use ckpt::{Checkpoint, Kind, Manifest, RankWriter, TensorBlock};
use half::bf16;
use model::{Llama, LlamaConfig, Placement};
use safetensors::SafeTensors;
use serde_json::json;

use crate::recipe::{load_stored, Dtype, Recipe};
use crate::train::checkpoint::tensor_block;

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

/// The tensors of a Hugging Face model directory (`model.safetensors` or the sharded index).
pub struct HfWeights {
    dir: PathBuf,
    maps: BTreeMap<String, memmap2::Mmap>,
    location: BTreeMap<String, String>,
}

impl HfWeights {
    /// Opens the weight files of `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index.exists() {
            let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&index)?)
                .with_context(|| index.display().to_string())?;
            let map = v["weight_map"]
                .as_object()
                .with_context(|| format!("{}: no weight_map", index.display()))?;
            let mut f: Vec<String> = map
                .values()
                .filter_map(|x| x.as_str().map(String::from))
                .collect();
            f.sort();
            f.dedup();
            f
        } else {
            vec!["model.safetensors".to_string()]
        };
        let (mut maps, mut location) = (BTreeMap::new(), BTreeMap::new());
        for f in files {
            let path = dir.join(&f);
            let file = std::fs::File::open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            // SAFETY: read-only map of a file nobody modifies while we read it.
            let map =
                unsafe { memmap2::Mmap::map(&file) }.with_context(|| path.display().to_string())?;
            let st = SafeTensors::deserialize(&map)
                .with_context(|| format!("{}: not a safetensors file", path.display()))?;
            for name in st.names() {
                location.insert(name.to_string(), f.clone());
            }
            maps.insert(f, map);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            maps,
            location,
        })
    }

    /// Tensor names present.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.location.keys()
    }

    /// Tensor `name` as f32 values, checked against `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let file = self
            .location
            .get(name)
            .with_context(|| format!("{}: no tensor {name}", self.dir.display()))?;
        let st = SafeTensors::deserialize(&self.maps[file])?;
        let t = st.tensor(name)?;
        if t.shape() != shape {
            bail!(
                "{}: {name} has shape {:?}, the model needs {shape:?}",
                self.dir.join(file).display(),
                t.shape()
            );
        }
        let b = t.data();
        Ok(match t.dtype() {
            safetensors::Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            safetensors::Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            safetensors::Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            d => bail!(
                "{}: {name} has unsupported dtype {d:?}",
                self.dir.join(file).display()
            ),
        })
    }
}

/// What `export-hf` wrote.
pub struct ExportSummary {
    /// Weight files written.
    pub files: Vec<String>,
    /// Bytes of weights.
    pub bytes: u64,
    /// Largest relative logit difference found by the parity gate.
    pub parity: f64,
}

fn hf_config(c: &LlamaConfig, dtype: Dtype, eos: u32) -> serde_json::Value {
    json!({
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
        "rope_scaling": null,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "tie_word_embeddings": c.tie_word_embeddings,
        "vocab_size": c.vocab_size,
        "initializer_range": c.init_std,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "use_cache": true,
        "torch_dtype": match dtype { Dtype::F32 => "float32", Dtype::Bf16 => "bfloat16" },
    })
}

fn to_bytes(v: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::Bf16 => v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect(),
    }
}

/// Exports the checkpoint `dir` to `out` in `dtype` (default: the training dtype).
pub fn export(
    dir: &Path,
    out: &Path,
    dtype: Option<Dtype>,
    max_shard_bytes: u64,
) -> Result<ExportSummary> {
    let ck = Checkpoint::open(dir)?;
    let recipe = checkpoint_recipe(&ck, &[])?;
    let (c, dtype) = (&recipe.model, dtype.unwrap_or(recipe.train.dtype));
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
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
    // Greedy sharding in model order.
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
            "model.safetensors".to_string()
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
            Ok(to_bytes(
                &ck.read_tensor(&s.name, Kind::Master, &s.shape)?,
                dtype,
            ))
        })?;
        for s in &part {
            weight_map.insert(s.name.clone(), json!(file));
        }
    }
    if n > 1 {
        let index = json!({ "metadata": { "total_size": bytes }, "weight_map": weight_map });
        std::fs::write(
            out.join("model.safetensors.index.json"),
            serde_json::to_vec_pretty(&index)?,
        )?;
    }
    let tokenizer = data::load_tokenizer(ck.tokenizer_path())?;
    let eos = data::eod_id(&tokenizer, &ck.tokenizer_path())?;
    std::fs::write(
        out.join("config.json"),
        serde_json::to_vec_pretty(&hf_config(c, dtype, eos))?,
    )?;
    let generation =
        json!({ "_from_model_config": true, "bos_token_id": eos, "eos_token_id": eos });
    std::fs::write(
        out.join("generation_config.json"),
        serde_json::to_vec_pretty(&generation)?,
    )?;
    std::fs::copy(ck.tokenizer_path(), out.join("tokenizer.json"))?;
    let tok_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": data::EOD_TOKEN,
        "eos_token": data::EOD_TOKEN,
        "model_max_length": c.max_position_embeddings,
        "clean_up_tokenization_spaces": false,
    });
    std::fs::write(
        out.join("tokenizer_config.json"),
        serde_json::to_vec_pretty(&tok_config)?,
    )?;

    // Parity gate: the exported files, loaded back, give the checkpoint's logits (with the
    // checkpoint's weights rounded to the export dtype). One model is alive at a time.
    let round = |v: Vec<f32>| match dtype {
        Dtype::F32 => v,
        Dtype::Bf16 => v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect(),
    };
    let tokens = parity_tokens(c)?;
    let expected = {
        let m = Llama::new(c, Placement::whole(c), 0, DType::F32, &Device::Cpu)?;
        m.load_weights(|p| -> Result<Vec<f32>> {
            Ok(round(ck.read_block(Kind::Master, tensor_block(p))?))
        })?;
        m.logits(&tokens)?
    };
    let got = {
        let hf = HfWeights::open(out)?;
        let m = Llama::new(c, Placement::whole(c), 0, DType::F32, &Device::Cpu)?;
        m.load_weights(|p| hf.get(&p.name, &p.global_shape))?;
        m.logits(&tokens)?
    };
    let scale = expected.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-12) as f64;
    let parity = (expected - got)?.abs()?.max_all()?.to_scalar::<f32>()? as f64 / scale;
    if parity > 1e-5 {
        bail!("export parity gate failed: logits of the exported model differ from the checkpoint's by {parity:.3e} (relative)");
    }
    Ok(ExportSummary {
        files: (0..n).map(name_of).collect(),
        bytes,
        parity,
    })
}

/// Two fixed sequences of up to 32 tokens for the parity gate.
fn parity_tokens(c: &LlamaConfig) -> Result<Tensor> {
    let s = c.max_position_embeddings.min(32);
    let ids: Vec<u32> = (0..2 * s as u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) % c.vocab_size as u32)
        .collect();
    Ok(Tensor::from_vec(ids, (2, s), &Device::Cpu)?)
}

/// Imports the Hugging Face Llama directory `model_dir` as a step-0 checkpoint of `recipe` under
/// `root` (fp32 masters from the weights, zero moments). Returns the step directory.
pub fn import(model_dir: &Path, recipe: &Recipe, root: &Path) -> Result<PathBuf> {
    let cfg_path = model_dir.join("config.json");
    let hf: serde_json::Value = serde_json::from_slice(
        &std::fs::read(&cfg_path).with_context(|| cfg_path.display().to_string())?,
    )
    .with_context(|| cfg_path.display().to_string())?;
    let c = &recipe.model;
    let ours = serde_json::to_value(c)?;
    let mut diff = Vec::new();
    for key in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rope_theta",
        "rms_norm_eps",
        "tie_word_embeddings",
    ] {
        let theirs = hf
            .get(key)
            .cloned()
            .unwrap_or(if key == "tie_word_embeddings" {
                json!(false)
            } else {
                serde_json::Value::Null
            });
        let same = match (theirs.as_f64(), ours[key].as_f64()) {
            (Some(a), Some(b)) => (a - b).abs() <= 1e-12 * b.abs().max(1.0),
            _ => theirs == ours[key],
        };
        if !same {
            diff.push(format!(
                "{key}: {} has {theirs}, recipe model.{key} is {}",
                cfg_path.display(),
                ours[key]
            ));
        }
    }
    if !hf.get("rope_scaling").is_none_or(|v| v.is_null()) {
        diff.push(format!(
            "rope_scaling: {} has {}, this model supports plain RoPE only",
            cfg_path.display(),
            hf["rope_scaling"]
        ));
    }
    if let Some(act) = hf.get("hidden_act").filter(|a| a.as_str() != Some("silu")) {
        diff.push(format!(
            "hidden_act: {} has {act}, this model uses silu (SwiGLU)",
            cfg_path.display()
        ));
    }
    if !diff.is_empty() {
        bail!(
            "the Hugging Face model does not match the recipe:\n  {}",
            diff.join("\n  ")
        );
    }
    let weights = HfWeights::open(model_dir)?;
    let shapes = c.tensor_shapes();
    for name in weights.names() {
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
    let tokenizer = model_dir.join("tokenizer.json");
    let tokenizer = if tokenizer.exists() {
        tokenizer
    } else {
        recipe.data.tokenizer.clone()
    };
    let manifest = Manifest {
        format: String::new(),
        step: 0,
        consumed_samples: 0,
        seed: recipe.train.seed,
        model: ours,
        recipe: serde_yaml::to_string(recipe)?,
        layout: serde_json::to_value(parallel::ParallelConfig::default())?,
        files: vec![],
        pieces: vec![],
    };
    Ok(ckpt::finalize(
        root,
        manifest,
        1,
        &tokenizer,
        recipe.checkpoint.keep.max(1),
    )?)
}
