//! The single-rank training loop: data → segments forward/backward → clipped AdamW step, with a
//! log line per step, periodic validation and run outputs.

pub mod metrics;
pub mod step;

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use data::{micro_batch_indices, GptData, Split};
use model::{llama::masked_mean, Llama};
use tracing::info;

use crate::optim::{AdamW, FlatLayout, GradBuffer};
use crate::recipe::{DeviceKind, Dtype, Recipe, Resume};
use crate::schedule::lr_at;
use metrics::{peak_rss_mib, EvalRecord, Metrics, StepRecord};
use step::{forward_backward, MicroBatch};

/// Everything one training run holds.
pub struct Trainer {
    recipe: Recipe,
    device: Device,
    model: Llama,
    grads: GradBuffer,
    optimizer: AdamW,
    train_data: GptData,
    valid_data: Option<GptData>,
    metrics: Option<Metrics>,
    /// Optimizer steps done.
    step: usize,
    /// Global samples consumed (the data loader's whole state).
    consumed: u64,
}

/// The compute device a recipe asks for.
pub fn device_for(kind: DeviceKind) -> Result<Device> {
    match kind {
        DeviceKind::Cpu => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => Ok(Device::new_cuda(0)?),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => {
            bail!("train.device is cuda but this binary was built without the `cuda` feature")
        }
    }
}

impl Trainer {
    /// Opens the data, builds the model and optimizer. `write_outputs` is false for in-memory runs
    /// (tests) that should leave no files.
    pub fn new(recipe: Recipe, write_outputs: bool) -> Result<Self> {
        if recipe.parallel.world_size() > 1 {
            bail!(
                "parallel: dp × tp × pp = {} ranks; this build trains on one rank (set parallel.dp = tp = pp = 1)",
                recipe.parallel.world_size()
            );
        }
        if recipe.checkpoint.interval > 0 || recipe.checkpoint.resume != Resume::None {
            bail!("checkpoint: saving and resuming are not available in this build; set checkpoint.interval: 0 and resume: none");
        }
        let device = device_for(recipe.train.device)?;
        let dtype = match recipe.train.dtype {
            Dtype::F32 => DType::F32,
            Dtype::Bf16 => DType::BF16,
        };
        let t = &recipe.train;
        let total_samples = (t.steps * t.global_batch) as u64;
        let train_data = GptData::open(
            &recipe.data,
            Path::new("."),
            Split::Train,
            t.seq_len,
            t.seed,
            total_samples,
        )
        .context("opening the training data")?;
        if train_data.vocab_size() > recipe.model.vocab_size {
            bail!(
                "model.vocab_size ({}) is smaller than the tokenizer's vocabulary ({})",
                recipe.model.vocab_size,
                train_data.vocab_size()
            );
        }
        let valid_data = if t.eval_interval > 0 {
            let n = (t.eval_batches * t.micro_batch) as u64;
            Some(
                GptData::open(
                    &recipe.data,
                    Path::new("."),
                    Split::Valid,
                    t.seq_len,
                    t.seed,
                    n,
                )
                .context("opening the validation data")?,
            )
        } else {
            None
        };
        let model = Llama::new(&recipe.model, t.seed, dtype, &device)?;
        let grads = GradBuffer::new(FlatLayout::of(model.params()), &device)?;
        let optimizer = AdamW::new(model.params(), &recipe.optimizer, &device)?;
        let metrics = if write_outputs {
            Some(Metrics::open(&recipe.run.dir)?)
        } else {
            None
        };
        if write_outputs {
            let path = recipe.run.dir.join("recipe.yaml");
            std::fs::write(&path, serde_yaml::to_string(&recipe)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(Self {
            recipe,
            device,
            model,
            grads,
            optimizer,
            train_data,
            valid_data,
            metrics,
            step: 0,
            consumed: 0,
        })
    }

    /// The model being trained.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// One optimizer step over the next global batch.
    pub fn train_step(&mut self) -> Result<StepRecord> {
        let start = Instant::now();
        let (t, r) = (&self.recipe.train, &self.recipe);
        self.grads.zero()?;
        let batches = micro_batch_indices(
            self.consumed,
            t.global_batch,
            t.micro_batch,
            0,
            r.parallel.dp,
        )
        .iter()
        .map(|ix| self.train_data.batch(ix))
        .collect::<Result<Vec<_>, _>>()?;
        let counted: f64 = batches
            .iter()
            .map(|b| b.loss_mask.iter().map(|&m| m as f64).sum::<f64>())
            .sum();
        let scale = 1.0 / counted.max(1.0);
        let mut loss = 0.0;
        for b in &batches {
            loss += forward_backward(
                &self.model,
                &MicroBatch::new(b, scale, &self.device)?,
                t.recompute,
                &self.grads,
            )?;
        }
        let grad_norm = self.grads.sum_squares()?.sqrt();
        if !grad_norm.is_finite() {
            bail!(
                "step {}: gradient norm is {grad_norm} (loss {loss}); stopping before the update",
                self.step + 1
            );
        }
        let clip = if t.grad_clip > 0.0 && grad_norm > t.grad_clip {
            t.grad_clip / (grad_norm + 1e-6)
        } else {
            1.0
        };
        let lr = lr_at(&r.schedule, r.optimizer.lr, self.step, t.steps);
        self.optimizer
            .step(self.model.params(), &self.grads, lr, clip)?;
        self.step += 1;
        self.consumed += t.global_batch as u64;

        let secs = start.elapsed().as_secs_f64();
        let tokens = (t.global_batch * t.seq_len) as f64;
        let tflops = tokens * r.model.flops_per_token(t.seq_len) / secs / 1e12;
        Ok(StepRecord {
            step: self.step,
            loss,
            lr,
            grad_norm,
            tokens_per_s: tokens / secs,
            tflops,
            mfu: r
                .run
                .peak_tflops
                .map(|p| tflops / (p * r.parallel.world_size() as f64)),
            mem_mib: peak_rss_mib(),
            consumed_samples: self.consumed,
            step_time_s: secs,
        })
    }

    /// Mean loss over the validation micro-batches (the same samples every time).
    pub fn evaluate(&self) -> Result<f64> {
        let Some(valid) = &self.valid_data else {
            bail!("validation is disabled (train.eval_interval = 0)")
        };
        let t = &self.recipe.train;
        let (mut sum, mut count) = (0.0, 0.0);
        for i in 0..t.eval_batches {
            let ix: Vec<u64> = (0..t.micro_batch)
                .map(|j| (i * t.micro_batch + j) as u64)
                .collect();
            let b = valid.batch(&ix)?;
            let tokens = Tensor::from_slice(&b.tokens, (b.micro_batch, b.seq_len), &self.device)?;
            let labels = Tensor::from_slice(&b.labels, b.labels.len(), &self.device)?;
            let mask = Tensor::from_slice(&b.loss_mask, b.loss_mask.len(), &self.device)?;
            let n: f64 = b.loss_mask.iter().map(|&m| m as f64).sum();
            sum += masked_mean(&self.model.token_losses(&tokens, &labels)?.detach(), &mask)? * n;
            count += n;
        }
        Ok(sum / count.max(1.0))
    }

    /// Trains for the recipe's steps; returns every step's record and the final validation loss.
    pub fn run(&mut self) -> Result<(Vec<StepRecord>, Option<f64>)> {
        let (steps, log_every, eval_every) = (
            self.recipe.train.steps,
            self.recipe.run.log_interval,
            self.recipe.train.eval_interval,
        );
        info!(
            "model: {} parameters, {} layers; {} micro-batches of {} × {} tokens per step",
            self.model.config().num_params(),
            self.model.config().num_hidden_layers,
            self.recipe.grad_accum_steps(),
            self.recipe.train.micro_batch,
            self.recipe.train.seq_len
        );
        let mut records = Vec::with_capacity(steps);
        let mut last_eval = None;
        while self.step < steps {
            let rec = self.train_step()?;
            if rec.step % log_every == 0 || rec.step == steps {
                let mfu = rec
                    .mfu
                    .map_or("n/a".to_string(), |m| format!("{:.1}%", 100.0 * m));
                info!(
                    "step={}/{} loss={:.4} lr={:.3e} grad_norm={:.3} tok/s={:.0} tflops={:.3} mfu={} mem={:.0}MiB",
                    rec.step, steps, rec.loss, rec.lr, rec.grad_norm, rec.tokens_per_s, rec.tflops, mfu, rec.mem_mib
                );
            }
            if let Some(m) = &mut self.metrics {
                m.step(&rec)?;
            }
            if eval_every > 0 && (rec.step % eval_every == 0 || rec.step == steps) {
                let val_loss = self.evaluate()?;
                info!("step={} val_loss={val_loss:.4}", rec.step);
                if let Some(m) = &mut self.metrics {
                    m.eval(&EvalRecord {
                        step: rec.step,
                        val_loss,
                    })?;
                    m.plot()?;
                }
                last_eval = Some(val_loss);
            }
            records.push(rec);
        }
        if let Some(m) = &self.metrics {
            m.plot()?;
        }
        Ok((records, last_eval))
    }
}
