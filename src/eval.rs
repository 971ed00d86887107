//! `pretrain eval`: the mean next-token loss of a checkpoint on a text file, at any layout the
//! checkpoint loads into. The text is tokenized with the checkpoint's tokenizer (no special tokens
//! added) and cut into consecutive non-overlapping windows of `seq_len + 1` tokens, where `seq_len`
//! is the model's `max_position_embeddings`; a last partial window is dropped.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use ckpt::stream::{write_streaming, TensorSpec};
use ckpt::{Checkpoint, Kind};
use data::Batch;
use model::Llama;
use parallel::comm::local::run_local;
use parallel::{Comm, ReduceOp};

use crate::hf::checkpoint_recipe;
use crate::recipe::Dtype;
use crate::train::checkpoint::tensor_block;
use crate::train::pipeline::forward_losses;
use crate::train::{device_for, RankCtx};

/// Windows evaluated per forward pass.
const WINDOWS_PER_BATCH: usize = 8;

/// Result of an evaluation.
#[derive(Debug, Clone)]
pub struct EvalResult {
    /// Mean loss over all predicted positions.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Windows evaluated.
    pub windows: usize,
    /// Predicted positions (`windows × seq_len`).
    pub tokens: usize,
}

/// Evaluates checkpoint `dir` on the text file `input`; `overrides` may change the layout
/// (`parallel.tp=2`, ...). With `logits_out`, the logits `[seq_len, vocab]` of the first window are
/// written there as safetensors (tensor `logits`, f32).
pub fn eval(
    dir: &Path,
    input: &Path,
    overrides: &[String],
    logits_out: Option<&Path>,
) -> Result<EvalResult> {
    if let Some(out) = logits_out {
        crate::files::refuse_output_over_input(out, &[input], "--logits-out")?;
    }
    let ck = Checkpoint::open(dir)?;
    let recipe = checkpoint_recipe(&ck, overrides)?;
    let p = &recipe.parallel;
    if logits_out.is_some() && (p.tp > 1 || p.cp > 1 || p.pp > 1 || p.ep > 1) {
        bail!(
            "--logits-out needs the whole model on one rank \
             (parallel.tp = parallel.cp = parallel.pp = parallel.ep = 1)"
        );
    }
    // Auxiliary-loss-free balancing: the model routes with the biases it trained with.
    let expert_bias = match &ck.manifest().trainer {
        serde_json::Value::Null => Default::default(),
        t => {
            serde_json::from_value::<crate::train::guard::LoopState>(t.clone())
                .with_context(|| format!("{}: trainer state of the manifest", dir.display()))?
                .expert_bias
        }
    };
    let tokenizer = data::load_tokenizer(ck.tokenizer_path())?;
    // A regular file, read whole (at most 1 GiB: evaluation text, not a corpus).
    let text = crate::files::read_text_capped(input, 1 << 30)?;
    let ids = data::tokenizer::encode_long(&tokenizer, &text)
        .map_err(|e| anyhow::anyhow!("{}: tokenizing: {e}", input.display()))?;
    let s = recipe.model.max_position_embeddings;
    let windows: Vec<&[u32]> = ids.chunks_exact(s + 1).collect();
    if windows.is_empty() {
        bail!(
            "{}: {} tokens, fewer than one window of {} tokens",
            input.display(),
            ids.len(),
            s + 1
        );
    }
    let timeout = Duration::from_secs_f64(recipe.parallel.timeout_s);
    let device = device_for(recipe.train.device, 0)?;
    let device = &device;
    let per_rank = run_local(
        recipe.parallel.world_size(),
        timeout,
        |rank, comm: Arc<dyn Comm>| {
            let go = || -> Result<(f64, f64)> {
                let ctx = RankCtx::open(&recipe.parallel, rank, comm.clone(), device.clone())?;
                let dtype = match recipe.train.dtype {
                    Dtype::F32 => DType::F32,
                    Dtype::Bf16 => DType::BF16,
                };
                let cfg = &recipe.model;
                let mut model = Llama::new(
                    cfg,
                    ctx.placement(cfg.num_hidden_layers),
                    recipe.train.seed,
                    dtype,
                    device,
                )?;
                model.load_weights(|p| -> Result<Vec<f32>> {
                    Ok(ck.read_block(Kind::Master, tensor_block(p))?)
                })?;
                model.set_expert_bias(&expert_bias);
                let mine: Vec<&[u32]> = windows
                    .iter()
                    .skip(ctx.data_index())
                    .step_by(ctx.data_size())
                    .copied()
                    .collect();
                let (mut sum, mut count) = (0f64, 0f64);
                // Expert-parallel ranks exchange tokens in every forward: all run as many
                // batches as the rank with the most windows; a rank out of windows repeats its
                // first batch and does not count it.
                let mut batches: Vec<(&[&[u32]], bool)> =
                    mine.chunks(WINDOWS_PER_BATCH).map(|b| (b, true)).collect();
                if ctx.groups.ep.size() > 1 {
                    let rounds = windows
                        .len()
                        .div_ceil(ctx.data_size())
                        .div_ceil(WINDOWS_PER_BATCH);
                    let spare = &windows[..1];
                    while batches.len() < rounds {
                        batches.push((batches.first().map_or(spare, |b| b.0), false));
                    }
                }
                for (batch, counted) in batches {
                    let b = ctx.local_batch(Batch {
                        tokens: batch.iter().flat_map(|w| w[..s].to_vec()).collect(),
                        labels: batch.iter().flat_map(|w| w[1..].to_vec()).collect(),
                        loss_mask: vec![1.0; batch.len() * s],
                        micro_batch: batch.len(),
                        seq_len: s,
                        doc_starts: None,
                    })?;
                    let t = Tensor::from_vec(b.tokens, (b.micro_batch, b.seq_len), device)?;
                    let l = Tensor::from_vec(b.labels, b.micro_batch * b.seq_len, device)?;
                    let losses = forward_losses(&model, &ctx, (&t, &l, None), &mut ())?;
                    if let Some(losses) = losses.filter(|_| counted) {
                        sum += losses.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
                        count += (b.micro_batch * b.seq_len) as f64;
                    }
                }
                if let (Some(path), true) = (
                    logits_out,
                    rank == 0
                        && [
                            &ctx.groups.tp,
                            &ctx.groups.cp,
                            &ctx.groups.pp,
                            &ctx.groups.ep,
                        ]
                        .iter()
                        .all(|g| g.size() == 1),
                ) {
                    let t = Tensor::from_vec(windows[0][..s].to_vec(), (1, s), device)?;
                    let logits = model
                        .logits(&t)?
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    let spec = [TensorSpec {
                        name: "logits".into(),
                        dtype: "F32",
                        shape: vec![s, cfg.vocab_size],
                    }];
                    // Beside the name and renamed over it: a link there is not written through.
                    crate::files::replace_with(path, |tmp| {
                        write_streaming(tmp, &spec, &BTreeMap::new(), |_| {
                            Ok(logits.iter().flat_map(|x| x.to_le_bytes()).collect())
                        })?;
                        Ok(())
                    })?;
                }
                let mut v = Tensor::new(&[sum, count], &candle_core::Device::Cpu)?;
                for group in [&ctx.groups.pp, &ctx.groups.grad] {
                    if group.size() > 1 {
                        v = comm.all_reduce(group, &v, ReduceOp::Sum)?;
                    }
                }
                let v = v.to_vec1::<f64>()?;
                Ok((v[0], v[1]))
            };
            go()
        },
    )
    .map_err(crate::train::root_cause)?;
    let (sum, count) = per_rank[0];
    let loss = sum / count;
    if !loss.is_finite() {
        bail!(
            "{}: the loss on {} is {loss}: the checkpoint's weights or the input overflow",
            dir.display(),
            input.display()
        );
    }
    Ok(EvalResult {
        loss,
        perplexity: loss.exp(),
        windows: windows.len(),
        tokens: count as usize,
    })
}
