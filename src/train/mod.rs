//! The training loop of one rank: its setup ([`Trainer::new`]), the loop with a log line per
//! step, periodic validation and run outputs ([`Trainer::run`]). One step (`step.rs`): data → the
//! step executor's schedule of forward and backward passes (`pipeline.rs`; gradients finalised and
//! synchronised across data-parallel ranks, and ZeRO applied, through its hooks: `hooks.rs`,
//! `zero.rs`) → exact global gradient norm → clipped AdamW step over the rank's owned flat ranges.
//! `run.rs` runs whole jobs ([`train`], [`run_rank`]).

pub mod checkpoint;
pub mod clock;
pub mod guard;
pub mod hooks;
pub mod lock;
pub mod metrics;
pub mod pipeline;
pub mod prefetch;
pub mod rank;
pub mod routing;
mod run;
mod saver;
pub mod signals;
mod step;
pub mod zero;

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use data::{GptData, Split};
use model::{llama::masked_mean, Llama};
use parallel::dp::DataParallel;
use parallel::pipeline::{check_fifo, validate, Schedule, ScheduleKind};
use parallel::{Comm, Group, ReduceOp};
use tracing::info;

use crate::optim::{AdamW, GradBuffer};
use crate::recipe::{DeviceKind, Recipe, Resume};
use hooks::StepSync;
use metrics::{EvalRecord, Metrics, StepRecord};
use parallel::dp::{Gatherer, Pass};
use pipeline::Timed;
pub use rank::RankCtx;
pub use run::{
    assemble, collect, device_for, root_cause, run_rank, train, RankOutput, RunOutput, WeightSlice,
};
use zero::piece_uses;

/// Everything one rank of a training run holds.
pub struct Trainer {
    recipe: Recipe,
    ctx: RankCtx,
    device: Device,
    model: Llama,
    grads: GradBuffer,
    optimizer: AdamW,
    /// Completes gradients as they become final (partial sums, data-parallel sync) and holds the
    /// ZeRO-3 parameter shards.
    dp: DataParallel,
    /// ZeRO-3: installs the parameters of the pieces being computed.
    gather: Option<Gatherer<model::Piece>>,
    /// The pieces this rank computes in a step, in order (what ZeRO-3 gathers ahead).
    uses: Vec<(model::Piece, usize, Pass)>,
    train_data: Arc<GptData>,
    /// The next step's micro-batches, read, cut to this rank's share and copied to the device
    /// on a background thread during this step.
    prefetch: prefetch::Prefetch<Vec<pipeline::Staged>>,
    valid_data: Option<GptData>,
    metrics: Option<Metrics>,
    /// Optimizer steps done.
    step: usize,
    /// Global samples consumed (the data loader's whole state).
    consumed: u64,
    /// The schedule of a step (one stage without pipeline parallelism).
    schedule: Schedule,
    /// The timed actions of the last step, for the timeline trace.
    timing: Vec<Timed>,
    /// When the last step's data-parallel bucket reductions ran: (bucket, seconds since the step
    /// began).
    sync_timing: Vec<(usize, std::ops::Range<f64>)>,
    /// The step guard's memory (skips, recent losses), saved in checkpoints.
    progress: guard::LoopState,
    /// A stop signal every rank saw by the end of the last step.
    stop: Option<i32>,
    /// The checkpoint being written in the background (`checkpoint.async`).
    saving: Option<std::thread::JoinHandle<Result<()>>>,
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn all_reduce_f64(comm: &dyn Comm, group: &Group, v: f64) -> Result<f64> {
    if group.size() == 1 {
        return Ok(v);
    }
    Ok(comm
        .all_reduce(group, &Tensor::new(&[v], &Device::Cpu)?, ReduceOp::Sum)?
        .to_vec1::<f64>()?[0])
}

impl Trainer {
    /// Opens the data, builds this rank's part of the model and its optimizer. `write_outputs` is
    /// false for in-memory runs (tests) that should leave no files.
    pub fn new(recipe: Recipe, ctx: RankCtx, write_outputs: bool) -> Result<Self> {
        let device = ctx.device.clone();
        if (recipe.train.device == DeviceKind::Cuda) != device.is_cuda() {
            bail!(
                "rank {}: train.device is {:?} but the rank was given {:?}",
                ctx.rank,
                recipe.train.device,
                device.location()
            );
        }
        let dtype = recipe.train.dtype.dtype();
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
        let train_data = Arc::new(train_data);
        let prefetch = {
            let (data, gb, mb) = (train_data.clone(), t.global_batch, t.micro_batch);
            let (index, size) = (ctx.data_index(), ctx.data_size());
            let (cp, cp_index, device) = (ctx.groups.cp.size(), ctx.coords.cp, device.clone());
            prefetch::Prefetch::new(
                &format!("data-rank{}", ctx.rank),
                Arc::new(move |consumed| {
                    data::micro_batch_indices(consumed, gb, mb, index, size)
                        .iter()
                        .map(|ix| {
                            let b = rank::local_batch(data.batch(ix)?, cp, cp_index)?;
                            pipeline::Staged::new(&b, &device)
                        })
                        .collect()
                }),
            )?
        };
        let valid_data = if t.eval_interval > 0 {
            let n = (t.eval_batches * t.global_batch) as u64;
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
        // The largest activations of a micro-batch must fit candle's 32-bit CUDA indexing too.
        let rows = t.micro_batch * t.seq_len / ctx.groups.cp.size();
        let tp = ctx.groups.tp.size();
        for (what, n) in [
            (
                "the logits of a micro-batch",
                rows * recipe.model.vocab_size / tp,
            ),
            (
                "the MLP activations of a micro-batch",
                rows * recipe.model.intermediate_size / tp,
            ),
        ] {
            crate::device::check_elements(what, n, &device)?;
        }
        let model = Llama::new(
            &recipe.model,
            ctx.placement(recipe.model.num_hidden_layers),
            t.seed,
            dtype,
            &device,
        )?;
        let zero::RankState {
            grads,
            optimizer,
            dp,
            gather,
        } = zero::rank_state(&recipe, &ctx, &model)?;
        let (v, m) = (ctx.virtual_stages, recipe.grad_accum_steps());
        let schedule = parallel::pipeline::build(
            ScheduleKind::for_virtual_stages(v),
            ctx.groups.pp.size(),
            v,
            m,
        )?;
        validate(&schedule)?;
        check_fifo(&schedule)?;
        let uses = piece_uses(
            &schedule,
            ctx.coords.pp,
            &ctx.chunks(model.config().num_hidden_layers),
        );
        let write = write_outputs && ctx.is_main();
        if write {
            let path = recipe.run.dir.join("recipe.yaml");
            std::fs::write(&path, serde_yaml::to_string(&recipe)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        let mut trainer = Self {
            recipe,
            ctx,
            device,
            model,
            grads,
            optimizer,
            dp,
            gather,
            uses,
            train_data,
            prefetch,
            valid_data,
            metrics: None,
            step: 0,
            consumed: 0,
            schedule,
            timing: Vec::new(),
            sync_timing: Vec::new(),
            progress: guard::LoopState::default(),
            stop: None,
            saving: None,
        };
        let from = match &trainer.recipe.checkpoint.resume {
            Resume::None => None,
            Resume::Auto => {
                ckpt::find_latest(&trainer.checkpoint_root()).context("checkpoint.resume=auto")?
            }
            Resume::Path(p) => Some(p.clone()),
        };
        if let Some(dir) = from {
            trainer
                .load_checkpoint(&dir)
                .with_context(|| format!("resuming from {}", dir.display()))?;
        }
        if write {
            trainer.metrics = Some(Metrics::open(&trainer.recipe.run.dir, trainer.step)?);
        }
        Ok(trainer)
    }

    /// This rank's part of the model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// Where this rank's parameters, gradients and optimizer state live in flat buffers.
    pub fn layout(&self) -> &parallel::dp::FlatLayout {
        self.dp.layout()
    }

    /// Mean loss over the validation micro-batches (the same samples every time), split across
    /// data-parallel ranks.
    pub fn evaluate(&mut self) -> Result<f64> {
        let Some(valid) = &self.valid_data else {
            bail!("validation is disabled (train.eval_interval = 0)")
        };
        let (t, ctx) = (&self.recipe.train, &self.ctx);
        let (mut sum, mut count) = (0.0, 0.0);
        let micro_batches = t.eval_batches * t.global_batch / t.micro_batch;
        let forwards: Vec<(model::Piece, usize, Pass)> = ctx
            .chunks(self.model.config().num_hidden_layers)
            .into_iter()
            .flatten()
            .map(|p| (p, 0, Pass::Forward))
            .collect();
        for i in (ctx.data_index()..micro_batches).step_by(ctx.data_size()) {
            let ix: Vec<u64> = (0..t.micro_batch)
                .map(|j| (i * t.micro_batch + j) as u64)
                .collect();
            let b = ctx.local_batch(valid.batch(&ix)?)?;
            let tokens = Tensor::from_slice(&b.tokens, (b.micro_batch, b.seq_len), &self.device)?;
            let labels = Tensor::from_slice(&b.labels, b.labels.len(), &self.device)?;
            let mask = Tensor::from_slice(&b.loss_mask, b.loss_mask.len(), &self.device)?;
            let n: f64 = b.loss_mask.iter().map(|&m| m as f64).sum();
            if let Some(g) = &mut self.gather {
                g.start(forwards.clone());
            }
            let mut hooks = StepSync {
                model: &self.model,
                grads: &self.grads,
                dp: &mut self.dp,
                gather: self.gather.as_mut(),
            };
            let losses = pipeline::forward_losses(&self.model, ctx, &tokens, &labels, &mut hooks)?;
            if let Some(g) = &mut self.gather {
                g.finish(self.model.params())?;
            }
            if let Some(l) = losses {
                sum += masked_mean(&l.detach(), &mask)? * n;
                count += n;
            }
        }
        let comm = ctx.comm.as_ref();
        let (sum, count) = (
            all_reduce_f64(comm, &ctx.groups.pp, sum)?,
            all_reduce_f64(comm, &ctx.groups.pp, count)?,
        );
        Ok(all_reduce_f64(comm, &ctx.groups.grad, sum)?
            / all_reduce_f64(comm, &ctx.groups.grad, count)?.max(1.0))
    }

    /// Trains for the recipe's steps; returns every step's record and the final validation loss.
    pub fn run(&mut self) -> Result<(Vec<StepRecord>, Option<f64>)> {
        let (steps, log_every, eval_every) = (
            self.recipe.train.steps,
            self.recipe.run.log_interval,
            self.recipe.train.eval_interval,
        );
        let main = self.ctx.is_main();
        if main {
            let p = &self.recipe.parallel;
            info!(
                "model: {} parameters, {} layers; layout dp={} tp={} cp={} pp={}{}{}; {} micro-batches of {} × {} tokens per rank and step",
                self.model.config().num_params(),
                self.model.config().num_hidden_layers,
                p.dp,
                p.tp,
                p.cp,
                p.pp,
                if p.sequence_parallel { " +sp" } else { "" },
                match (p.zero, p.zero_shard_size) {
                    (parallel::dp::ZeroStage::Off, _) => String::new(),
                    (z, Some(n)) => format!(" +zero{z} (shards of {n})"),
                    (z, None) => format!(" +zero{z}"),
                },
                self.recipe.grad_accum_steps(),
                self.recipe.train.micro_batch,
                self.recipe.train.seq_len / p.cp
            );
            let b = self.state_bytes();
            info!(
                "rank 0 state: parameters {:.2} MiB, gradients {:.2} MiB, optimizer {:.2} MiB",
                mib(b.param_bytes),
                mib(b.grad_bytes),
                mib(b.optimizer_bytes)
            );
        }
        let mut records = Vec::new();
        let mut last_eval = None;
        while self.step < steps {
            let rec = self.train_step()?;
            if main && (rec.step % log_every == 0 || rec.step == steps) {
                let mfu = rec
                    .mfu
                    .map_or("n/a".to_string(), |m| format!("{:.1}%", 100.0 * m));
                let gathers = rec.gather_s.map_or(String::new(), |s| {
                    let hidden = rec.gather_hidden.unwrap_or(0.0);
                    format!(" gathers={:.0}ms ({:.0}% hidden)", 1e3 * s, 100.0 * hidden)
                });
                let ring = rec.ring_s.map_or(String::new(), |s| {
                    let exposed = rec.ring_exposed_s.unwrap_or(0.0);
                    format!(" ring={:.0}ms ({:.0}ms exposed)", 1e3 * s, 1e3 * exposed)
                });
                // On a GPU: the device memory allocated at the step's end and its peak.
                let mem = match (rec.device_mem_mib, rec.device_peak_mib) {
                    (Some(now), Some(peak)) => format!("{now:.0}MiB (peak {peak:.0}MiB)"),
                    _ => format!("{:.0}MiB", rec.mem_mib),
                };
                let moe = rec.moe.as_ref().map_or(String::new(), |m| {
                    let bias = m
                        .bias_max_abs
                        .map_or(String::new(), |b| format!(" |bias|<={b:.4}"));
                    let bias = match m.dropped {
                        Some(d) => format!("{bias} dropped={:.2}%", 100.0 * d),
                        None => bias,
                    };
                    format!(
                        " moe_lb={:.3} moe_z={:.3} max/mean={:.2}{bias}",
                        m.load_balancing, m.z_loss, m.max_over_mean
                    )
                });
                let skip = if rec.skipped.is_some() {
                    " (update skipped)"
                } else {
                    ""
                };
                info!(
                    "step={}/{} loss={:.4} lr={:.3e} grad_norm={:.3} tok/s={:.0} tflops={:.3} mfu={} mem={mem} state={:.1}MiB acts={:.1}MiB units={:.1}MiB{gathers}{ring}{moe}{skip}",
                    rec.step, steps, rec.loss, rec.lr, rec.grad_norm, rec.tokens_per_s, rec.tflops, mfu,
                    mib(rec.state.total()), mib(rec.act_peak_bytes), mib(rec.param_unit_peak_bytes + rec.grad_unit_peak_bytes)
                );
            }
            if main && self.recipe.run.trace_step == Some(rec.step) {
                let path = self.recipe.run.dir.join("trace.json");
                info!("step={} timeline: {}", rec.step, path.display());
            }
            if let (true, Some(b)) = (main, rec.bubble) {
                let (p, v, m) = (
                    self.ctx.groups.pp.size() as f64,
                    self.ctx.virtual_stages as f64,
                    self.recipe.grad_accum_steps() as f64,
                );
                info!(
                    "step={} pipeline bubble: measured {:.3} of the pipeline phase; ideal (p-1)/(v·m+p-1) = {:.3}, i.e. (p-1)/(v·m) = {:.3} of the compute time",
                    rec.step,
                    b,
                    (p - 1.0) / (v * m + p - 1.0),
                    (p - 1.0) / (v * m),
                );
            }
            if let (true, Some(o), Some(t)) = (main, rec.sync_overlap, rec.sync_exposed_s) {
                info!(
                    "step={} data-parallel gradient sync: {:.0}% of the buckets reduced during the backward passes; the step waited {:.1} ms for the rest",
                    rec.step,
                    100.0 * o,
                    1e3 * t
                );
            }
            if let Some(m) = &mut self.metrics {
                m.step(&rec)?;
            }
            if eval_every > 0 && (rec.step % eval_every == 0 || rec.step == steps) {
                let val_loss = self.evaluate()?;
                if main {
                    info!("step={} val_loss={val_loss:.4}", rec.step);
                }
                if let Some(m) = &mut self.metrics {
                    m.eval(&EvalRecord {
                        step: rec.step,
                        val_loss,
                    })?;
                    m.plot()?;
                }
                last_eval = Some(val_loss);
            }
            let every = self.recipe.checkpoint.interval;
            // A stop signal during the last step changes nothing: the run is complete.
            if self.step == steps {
                self.stop = None;
            }
            let saved = if (every > 0 && (rec.step % every == 0 || rec.step == steps))
                || self.stop.is_some()
            {
                Some(
                    self.save_checkpoint()
                        .with_context(|| format!("saving the checkpoint of step {}", rec.step))?,
                )
            } else {
                None
            };
            records.push(rec);
            if let Some(signal) = self.stop {
                self.wait_for_save()?;
                if let Some(m) = &self.metrics {
                    m.plot()?;
                }
                let stop = signals::Interrupted {
                    signal,
                    step: Some(self.step),
                    checkpoint: saved,
                };
                if main {
                    tracing::warn!("{stop}");
                }
                return Err(stop.into());
            }
        }
        self.wait_for_save()?;
        if let Some(m) = &self.metrics {
            m.plot()?;
        }
        Ok((records, last_eval))
    }

    /// This rank's parameter slices: `(name, global shape, slice, values)`.
    pub fn weight_slices(&self) -> Result<Vec<WeightSlice>> {
        // One copy to the host: a narrowed device tensor would copy its whole buffer each time.
        let whole = zero::whole_params(&self.dp, &self.model)?.to_device(&Device::Cpu)?; // [layout.total] f32
        let layout = self.dp.layout();
        self.model
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let r = layout.range(i);
                Ok(WeightSlice {
                    name: p.name.clone(),
                    global_shape: p.global_shape.clone(),
                    block: p.block.clone(),
                    values: whole.narrow(0, r.start, r.len())?.to_vec1::<f32>()?,
                })
            })
            .collect()
    }
}
