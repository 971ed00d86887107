//! The training loop of one rank: its setup ([`Trainer::new`]), the loop with a log line per
//! step, periodic validation and run outputs ([`Trainer::run`]). One step (`step.rs`): data → the
//! step executor's schedule of forward and backward passes (`pipeline.rs`; gradients finalised and
//! synchronised across data-parallel ranks, and ZeRO applied, through its hooks: `hooks.rs`,
//! `zero.rs`) → exact global gradient norm → clipped AdamW step over the rank's owned flat ranges.
//! `run.rs` runs whole jobs ([`train`], [`run_rank`]).

pub mod admit;
mod ahead;
pub mod checkpoint;
pub mod clock;
pub mod guard;
pub mod hooks;
pub mod lock;
pub mod metrics;
mod micro;
pub mod order;
pub mod pipeline;
mod plot;
pub mod prefetch;
pub mod rank;
mod report;
mod resume;
pub mod routing;
mod run;
mod saver;
mod splits;
mod step;
pub mod stragglers;
pub mod tensorboard;
mod walk;
pub mod zero;

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use model::{llama::masked_mean, Llama};
use parallel::pipeline::{check_fifo, validate, Schedule, SimCosts};
use parallel::{Comm, Group, ReduceOp};
use tracing::{info, warn};

use crate::recipe::{DeviceKind, Recipe, Resume};
use hooks::StepSync;
use metrics::{EvalRecord, Metrics, StepRecord};
use parallel::dp::Pass;
use pipeline::Timed;
pub use rank::RankCtx;
pub use report::loss_text;
pub use run::{
    assemble, collect, device_for, root_cause, run_rank, train, train_to_files, RankOutput,
    RunOutput, WeightSlice,
};
use splits::RankData;
use zero::piece_uses;

/// Everything one rank of a training run holds.
pub struct Trainer {
    recipe: Recipe,
    ctx: RankCtx,
    model: Llama,
    /// Gradients, optimizer, gradient completion and (ZeRO-3) the parameter gatherer.
    state: zero::RankState,
    /// The training and validation splits, and the prefetch thread.
    data: RankData,
    /// What a step runs, in which order.
    plan: StepPlan,
    /// Optimizer steps done.
    step: usize,
    /// Global samples consumed (the data loader's whole state).
    consumed: u64,
    /// The step guard's memory (skips, recent losses), saved in checkpoints.
    progress: guard::LoopState,
    /// Where the run's numbers go.
    observe: Observers,
    /// Checkpoints being written and what they record of the data.
    saves: Saves,
    /// Where the rank stands between steps.
    edge: StepEdge,
}

/// Where a rank stands between steps: a stop signal it must act on, and what the host has not
/// yet waited the device for.
#[derive(Default)]
struct StepEdge {
    /// A stop signal every rank saw by the end of the last step.
    stop: Option<i32>,
    /// The step whose update has not yet been checked for non-finite values (`guard.rs`).
    unsettled: Option<usize>,
    /// When the last step ended, while nothing but the loop's bookkeeping has run since: where
    /// the next step's time starts with `run.timing: overlapped`.
    last_end: Option<std::time::Instant>,
}

/// The schedule of a rank's step and what follows from it.
struct StepPlan {
    /// The schedule of a step (one stage without pipeline parallelism).
    schedule: Schedule,
    /// The pieces this rank computes in a step, in order (what ZeRO-3 gathers ahead).
    uses: Vec<(model::Piece, usize, Pass)>,
    /// The step after which the schedule's order is fitted to that step's measured costs (zbv;
    /// see `order.rs`), until it is.
    reorder_at: Option<usize>,
}

/// The run's outputs of numbers: the metrics log, the flight recorder and the last step's
/// timings for the timeline trace.
#[derive(Default)]
struct Observers {
    metrics: Option<Metrics>,
    /// The flight recorder of this rank's communicator, told the step.
    flight: Option<Arc<parallel::comm::flight::FlightRecorder>>,
    /// The timed actions of the last step, for the timeline trace.
    timing: Vec<Timed>,
    /// When the last step's data-parallel bucket reductions ran: (bucket, seconds since the step
    /// began).
    sync_timing: Vec<(usize, std::ops::Range<f64>)>,
}

/// Checkpoint saving's own state.
#[derive(Default)]
struct Saves {
    /// The checkpoint being written in the background (`checkpoint.async`).
    saving: Option<std::thread::JoinHandle<Result<()>>>,
    /// The recipe's datasets as they are on disk (`resume.rs`), read once when first needed.
    datasets: std::sync::OnceLock<Vec<ckpt::DatasetEntry>>,
}

fn all_reduce_f64(comm: &dyn Comm, group: &Group, v: f64) -> Result<f64> {
    if group.size() == 1 {
        return Ok(v);
    }
    Ok(comm
        .all_reduce(group, &Tensor::new(&[v], &Device::Cpu)?, ReduceOp::Sum)?
        .to_vec1::<f64>()?[0])
}

/// A run from step 0 (`checkpoint.resume=none`) would save over the checkpoints of an earlier
/// run in `root`, and `latest` would name its own: refused before anything is written.
fn refuse_earlier_checkpoints(root: &std::path::Path) -> Result<()> {
    if let Some(newest) = ckpt::saved_steps(root)?.last() {
        bail!(
            "checkpoint.resume=none, but {} holds checkpoints of an earlier run (the newest of \
             step {newest}), which this run would save over: continue them with --set \
             checkpoint.resume=auto, or start over in another run.dir (or checkpoint.dir), or \
             remove {}",
            root.display(),
            root.display()
        );
    }
    Ok(())
}

impl Trainer {
    /// Tells `recorder` (the flight recorder of this rank's communicator) each step.
    pub fn set_flight(&mut self, recorder: Arc<parallel::comm::flight::FlightRecorder>) {
        self.observe.flight = Some(recorder);
    }

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
        if write_outputs && recipe.checkpoint.resume == Resume::None {
            refuse_earlier_checkpoints(&recipe.checkpoint_root())?;
        }
        let data = RankData::open(&recipe, &ctx)?;
        // (Tensors bounded by candle's 32-bit CUDA indexing are checked with the state layout,
        // `zero::rank_state`.)
        let model = zero::rank_model(&recipe, &ctx)?;
        let state = zero::rank_state(&recipe, &ctx, &model)?;
        let m = recipe.grad_accum_steps();
        let schedule = crate::plan::memory::schedule(&recipe, m)?;
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
            crate::files::write_replacing(&path, serde_yaml::to_string(&recipe)?.as_bytes())?;
        }
        let mut trainer = Self {
            recipe,
            ctx,
            model,
            state,
            data,
            plan: StepPlan {
                schedule,
                uses,
                reorder_at: None,
            },
            step: 0,
            consumed: 0,
            progress: guard::LoopState::default(),
            observe: Observers::default(),
            saves: Saves::default(),
            edge: StepEdge::default(),
        };
        let from = match &trainer.recipe.checkpoint.resume {
            Resume::None => None,
            Resume::Auto => {
                let root = trainer.checkpoint_root();
                let found = ckpt::find_latest(&root).context("checkpoint.resume=auto")?;
                if found.is_none() && trainer.ctx.is_main() {
                    info!(
                        "checkpoint.resume=auto: no checkpoint in {}; starting from step 0",
                        root.display()
                    );
                }
                found
            }
            Resume::Path(p) => Some(p.clone()),
        };
        if let Some(dir) = from {
            trainer
                .load_checkpoint(&dir)
                .with_context(|| format!("resuming from {}", dir.display()))?;
        }
        if order::tuned(
            trainer.recipe.parallel.schedule_kind(),
            trainer.plan.schedule.pp,
        ) {
            match trainer.progress.schedule_costs {
                Some([forward, backward, weight]) => trainer.set_order(SimCosts {
                    forward,
                    backward,
                    weight,
                })?,
                None => trainer.plan.reorder_at = Some(trainer.step + 2),
            }
        }
        if write {
            trainer.observe.metrics = Some(Metrics::open(
                &trainer.recipe.run.dir,
                trainer.step,
                trainer.recipe.run.tensorboard,
            )?);
        }
        Ok(trainer)
    }

    /// This rank's part of the model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// Where this rank's parameters, gradients and optimizer state live in flat buffers.
    pub fn layout(&self) -> &parallel::dp::FlatLayout {
        self.state.dp.layout()
    }

    /// Mean loss over the validation micro-batches (the same samples every time), split across
    /// data-parallel ranks.
    pub fn evaluate(&mut self) -> Result<f64> {
        let Some(valid) = &self.data.valid else {
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
            let tokens =
                Tensor::from_slice(&b.tokens, (b.micro_batch, b.seq_len), &self.ctx.device)?;
            let labels = Tensor::from_slice(&b.labels, b.labels.len(), &self.ctx.device)?;
            let mask = Tensor::from_slice(&b.loss_mask, b.loss_mask.len(), &self.ctx.device)?;
            let n: f64 = b.loss_mask.iter().map(|&m| m as f64).sum();
            if let Some(g) = &mut self.state.gather {
                g.start(forwards.clone());
            }
            let mut hooks = StepSync {
                model: &self.model,
                grads: &self.state.grads,
                dp: &mut self.state.dp,
                gather: self.state.gather.as_mut(),
            };
            let docs = pipeline::documents(&b)?;
            let inputs = (&tokens, &labels, docs.as_ref());
            let losses = pipeline::forward_losses(&self.model, ctx, inputs, &mut hooks)?;
            if let Some(g) = &mut self.state.gather {
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
        let (sum, count) = (
            all_reduce_f64(comm, &ctx.groups.grad, sum)?,
            all_reduce_f64(comm, &ctx.groups.grad, count)?,
        );
        // No loss target at all: no loss (NaN, `null` in the record), not a perfect 0.
        Ok(if count > 0.0 { sum / count } else { f64::NAN })
    }

    /// Trains for the recipe's steps; returns every step's record and the final validation loss.
    pub fn run(&mut self) -> Result<(Vec<StepRecord>, Option<f64>)> {
        let steps = self.recipe.train.steps;
        let main = self.ctx.is_main();
        if main {
            self.log_start();
        }
        let mut records = Vec::new();
        let mut last_eval = None;
        while self.step < steps {
            let rec = self.train_step()?;
            if main {
                self.log_step(&rec);
            }
            if let Some(m) = &mut self.observe.metrics {
                m.step(&rec)?;
            }
            // A stop signal during the last step changes nothing: the run is complete.
            if self.step == steps {
                self.edge.stop = None;
            }
            // A stopping run saves without validating first; a signal that arrives during a
            // validation stops the run after it.
            if self.validates_after(rec.step) && self.edge.stop.is_none() {
                self.settle()?;
                last_eval = Some(self.validate(rec.step)?);
                if self.step < steps {
                    self.edge.stop = self.stop_signal()?;
                }
            }
            let saved = self.save_if_due(rec.step)?;
            records.push(rec);
            if let Some(signal) = self.edge.stop {
                return Err(self.interrupted(signal, saved)?.into());
            }
        }
        self.settle()?;
        self.wait_for_save()?;
        if let Some(m) = &self.observe.metrics {
            m.plot()?;
        }
        Ok((records, last_eval))
    }

    /// Validation after step `step`: logged, recorded and plotted.
    fn validate(&mut self, step: usize) -> Result<f64> {
        self.edge.last_end = None; // the next step's time starts with it
        let val_loss = self.evaluate()?;
        if self.ctx.is_main() {
            let text = report::loss_text(val_loss);
            if val_loss.is_nan() {
                warn!(
                    "step={step} val_loss={text}: no token of the validation samples has a loss \
                     target (data.eod_mask_loss masks them all)"
                );
            } else {
                info!("step={step} val_loss={text}");
            }
        }
        if let Some(m) = &mut self.observe.metrics {
            m.eval(&EvalRecord { step, val_loss })?;
            m.plot()?;
        }
        Ok(val_loss)
    }

    /// Whether a validation follows step `step` (`train.eval_interval`, and the last step).
    fn validates_after(&self, step: usize) -> bool {
        let (every, steps) = (self.recipe.train.eval_interval, self.recipe.train.steps);
        every > 0 && (step.is_multiple_of(every) || step == steps)
    }

    /// Whether a checkpoint follows step `step` (`checkpoint.interval`, and the last step),
    /// a stop signal aside.
    fn saves_after(&self, step: usize) -> bool {
        let (every, steps) = (self.recipe.checkpoint.interval, self.recipe.train.steps);
        every > 0 && (step.is_multiple_of(every) || step == steps)
    }

    /// Saves the checkpoint of step `step` when the interval, the last step or a stop signal
    /// asks for one.
    fn save_if_due(&mut self, step: usize) -> Result<Option<std::path::PathBuf>> {
        if self.saves_after(step) || self.edge.stop.is_some() {
            self.edge.last_end = None;
            // A failed background save is reported as its own step's, not this one's.
            self.wait_for_save()?;
            let saved = self
                .save_checkpoint()
                .with_context(|| format!("saving the checkpoint of step {step}"))?;
            Ok(Some(saved))
        } else {
            Ok(None)
        }
    }

    /// A run stopped by `signal` after its checkpoint `saved` was written: waits for the save,
    /// plots, and says so.
    fn interrupted(
        &mut self,
        signal: i32,
        saved: Option<std::path::PathBuf>,
    ) -> Result<crate::job::signals::Interrupted> {
        self.wait_for_save()?;
        if let Some(m) = &self.observe.metrics {
            m.plot()?;
        }
        let stop = crate::job::signals::Interrupted {
            signal,
            step: Some(self.step),
            checkpoint: saved,
            note: None,
        };
        if self.ctx.is_main() {
            tracing::warn!("{stop}");
        }
        Ok(stop)
    }

    /// This rank's parameter slices: `(name, global shape, slice, values)`. After
    /// [`Trainer::run`], whose end checks the last update; a caller exporting after
    /// [`Trainer::train_step`] calls [`Trainer::settle`] first.
    pub fn weight_slices(&self) -> Result<Vec<WeightSlice>> {
        // One copy to the host: a narrowed device tensor would copy its whole buffer each time.
        let whole = zero::whole_params(&self.state.dp, &self.model)?.to_device(&Device::Cpu)?; // [layout.total] f32
        let layout = self.state.dp.layout();
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
