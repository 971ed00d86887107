//! The step executor: every rank's forward and backward passes of a training step, pipelined or
//! not. A rank runs its action list of a pipeline [`Schedule`] — forward and backward of its model
//! chunks per micro-batch, and the sends and receives of activations and gradients around them —
//! over the segment mechanism, adding each piece's parameter gradients into the flat buffer right
//! after that piece's backward (a zero-bubble schedule's split backward leaves a block's
//! projection gradients to a later weight action). A rank without pipeline parallelism runs a
//! one-stage schedule
//! (forward then backward of each micro-batch), so there is one step path for every layout.
//!
//! [`Executor::step`] walks the schedule; what it keeps track of on the way is in small parts of
//! their own (`walk.rs`): when a parameter's gradient is final (`Finality`, which fires the
//! data-parallel hook), which activations are held (`Activations`), the weight gradients a
//! split backward leaves for its weight action (`Deferred`), and when each action ran
//! ([`super::clock::Timeline`]). The parallelisms that act around pieces hook in through
//! [`StepHooks`] (`hooks.rs`). Point-to-point channels carry no tags; schedules are checked with
//! `parallel::pipeline::check_fifo` before use. Also here: the forward-only pass of evaluation
//! ([`forward_losses`]).

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Shape, Tensor};
use model::moe::LayerStats;
use model::segment::{self, ParamGrad};
use model::{DocumentStarts, Llama, Piece, Recompute, Targets};
use parallel::pipeline::{Action, Schedule};
use parallel::Comm;

pub use super::clock::Timed;
use super::clock::Timeline;
use super::hooks::StepHooks;
pub use super::micro::{documents, MicroBatch, Staged};
use super::walk::{compact, Deferred, Finality, Live, Walk};
use super::RankCtx;
use crate::optim::GradBuffer;

/// What a rank's run of a step produced (its gradients are in the gradient buffer).
pub struct StepRun {
    /// The summed scaled loss of the micro-batches whose head is on this rank (0 elsewhere).
    pub loss: f64,
    /// Every action with its start and end.
    pub timing: Vec<Timed>,
    /// Peak bytes of activations kept for backward passes (`walk.rs`'s `Activations`).
    pub act_peak_bytes: usize,
    /// What the MoE layers of this rank measured, one entry per layer and micro-batch.
    pub moe: Vec<LayerStats>,
    /// Tensors carrying an autograd graph among everything the step kept and produced (tapes,
    /// outputs, gradients): the pieces build none, so this is zero.
    pub tracked: usize,
}

/// One rank's executor of a step's schedule.
pub struct Executor<'a> {
    model: &'a Llama,
    schedule: &'a Schedule,
    comm: &'a dyn Comm,
    /// This rank's pipeline stage.
    stage: usize,
    /// Global rank of each pipeline stage of this rank's pipeline.
    stage_ranks: &'a [usize],
    /// The pieces of each local chunk.
    chunks: Vec<Vec<Piece>>,
    /// Shape of the activations between chunks, `[b, s (/ tp with sequence parallelism), h]`.
    act_shape: Shape,
    /// Their dtype (the parameters').
    dtype: DType,
    recompute: Recompute,
    /// Whether the schedule splits backwards (zero-bubble): blocks then leave their weight
    /// gradients to [`Action::Weight`].
    split: bool,
    /// Time every action on this device's timeline (see [`Executor::timed_on_device`]).
    device_timed: Option<&'a Device>,
    /// Tests: a pause in each forward action of this rank (an injected fault, `crate::faults`).
    slow: Option<std::time::Duration>,
}

impl<'a> Executor<'a> {
    /// The executor of rank `ctx` running `schedule` over `model` (this rank's part) for
    /// micro-batches of `micro_batch` sequences of `seq_len` tokens.
    pub fn new(
        model: &'a Llama,
        ctx: &'a RankCtx,
        schedule: &'a Schedule,
        recompute: Recompute,
        micro_batch: usize,
        seq_len: usize,
    ) -> Self {
        let cfg = model.config();
        Self {
            model,
            schedule,
            comm: ctx.comm.as_ref(),
            stage: ctx.coords.pp,
            stage_ranks: ctx.groups.pp.ranks(),
            chunks: ctx.chunks(cfg.num_hidden_layers),
            act_shape: ctx.activation_shape(micro_batch, seq_len, cfg.hidden_size),
            dtype: model.params().get(0).dtype,
            recompute,
            split: schedule.splits_backward(),
            device_timed: None,
            slow: crate::faults::faults().slowdown(ctx.rank),
        }
    }

    /// Times every action on the device: on a GPU from timing events recorded on the device
    /// stream around it, read after the step ([`super::clock::StepClock`]); on the CPU from the
    /// host clock as usual. On a GPU, actions otherwise return once their kernels are queued, and
    /// a timeline of enqueue times says little about the bubble or the overlap. Only the traced
    /// step uses it (two events per action).
    pub fn timed_on_device(mut self, device: &'a Device) -> Self {
        self.device_timed = Some(device);
        self
    }

    /// Runs this rank's actions for `mbs` (one per micro-batch), adding gradients into `grads`
    /// and calling `hooks` around every piece. `clock` is the step's start, for the timings.
    pub fn step(
        &self,
        mbs: &[MicroBatch],
        grads: &GradBuffer,
        hooks: &mut dyn StepHooks,
        clock: Instant,
    ) -> Result<StepRun> {
        if mbs.len() != self.schedule.m {
            bail!(
                "{} micro-batches for a schedule of {}",
                mbs.len(),
                self.schedule.m
            );
        }
        let mut finality = Finality::new(self.model, &self.chunks, mbs.len());
        let mut timeline = Timeline::new(self.device_timed, clock)?;
        let device = self.model.params().iter().next().map(|p| p.device.clone());
        let mut w = Walk {
            ahead: super::ahead::RunAhead::on(&device.unwrap_or(Device::Cpu)),
            ..Walk::default()
        };
        for &action in &self.schedule.actions[self.stage] {
            let begin = timeline.mark()?;
            match action {
                Action::RecvActivation { chunk, micro, from } => {
                    w.acts.insert((chunk, micro), self.recv(from)?);
                }
                Action::RecvGrad { chunk, micro, from } => {
                    w.dys.insert((chunk, micro), self.recv(from)?);
                }
                Action::Forward { chunk, micro } => {
                    if let Some(pause) = self.slow {
                        std::thread::sleep(pause);
                    }
                    w.ahead.before_forward()?;
                    self.forward(chunk, micro, &mbs[micro], hooks, &mut w)?;
                    w.ahead.after_forward()?;
                }
                Action::SendActivation { chunk, micro, to } => {
                    let out = w
                        .live
                        .get_mut(&(chunk, micro))
                        .and_then(|l| l.output.take());
                    let out = out.with_context(|| format!("nothing to send for {action}"))?;
                    self.comm.send(&out, self.stage_ranks[to])?;
                }
                Action::Backward { chunk, micro } => {
                    let targets = &mbs[micro].targets;
                    self.backward(chunk, micro, targets, grads, hooks, &mut finality, &mut w)?;
                }
                Action::Weight { chunk, micro } => {
                    self.weight(chunk, micro, grads, hooks, &mut finality, &mut w)?;
                }
                Action::SendGrad { chunk, micro, to } => {
                    let g = w.live.remove(&(chunk, micro)).and_then(|l| l.input_grad);
                    let g = g.with_context(|| format!("no input gradient for {action}"))?;
                    self.comm.send(&g, self.stage_ranks[to])?;
                }
            }
            timeline.record(action, begin)?;
        }
        let loss = w.loss.map_or(Ok(0.0), |l| l.to_scalar::<f64>())?;
        Ok(StepRun {
            loss,
            timing: timeline.finish()?,
            act_peak_bytes: w.held.peak,
            moe: w.moe,
            tracked: w.tracked,
        })
    }

    /// The forward of chunk `chunk` for micro-batch `micro` (`mb`): its pieces in order, each a
    /// segment whose run is kept for the backward.
    fn forward(
        &self,
        chunk: usize,
        micro: usize,
        mb: &MicroBatch,
        hooks: &mut dyn StepHooks,
        w: &mut Walk,
    ) -> Result<()> {
        let pieces = &self.chunks[chunk];
        let mut x = match pieces.first() {
            Some(Piece::Embedding) => mb.tokens.clone(),
            _ => w
                .acts
                .remove(&(chunk, micro))
                .with_context(|| format!("no activation for the forward of {chunk}.{micro}"))?,
        };
        let mut runs = Vec::with_capacity(pieces.len());
        for &p in pieces {
            hooks.before_forward(p, micro)?;
            let mode = self.recompute.for_piece(p);
            let (y, run, moe) = segment::forward(self.model, p, &x, &mb.targets, mode)?;
            hooks.after_forward(p, micro)?;
            w.moe.extend(moe);
            w.tracked += run.tracked() + segment::tracked(&[&y]);
            let held = run.held();
            w.held.add(&held);
            runs.push((run, held));
            x = y;
        }
        let output = if pieces.last() == Some(&Piece::Head) {
            let x = x.to_dtype(DType::F64)?;
            w.loss = Some(match w.loss.take() {
                Some(sum) => (sum + x)?,
                None => x,
            });
            None
        } else if let Some(next) = self.local_neighbour(chunk, 1) {
            w.acts.insert((next, micro), x); // the next chunk is on this stage (a V's turn)
            None
        } else {
            Some(x)
        };
        let state = Live {
            runs,
            output,
            input_grad: None,
        };
        w.live.insert((chunk, micro), state);
        Ok(())
    }

    /// The backward of chunk `chunk` for micro-batch `micro`: its pieces in reverse, each
    /// piece's gradients added into `grads` right after its backward — but a block's in a split
    /// schedule, which are kept for the weight action ([`Executor::weight`]). The embedding's
    /// and the head's are added here in either case: the head's factors would hold the logits'
    /// gradient `[b·s, vocab]` until then, and the embedding's are a scatter-add.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        chunk: usize,
        micro: usize,
        targets: &Targets,
        grads: &GradBuffer,
        hooks: &mut dyn StepHooks,
        finality: &mut Finality,
        w: &mut Walk,
    ) -> Result<()> {
        let l = w
            .live
            .remove(&(chunk, micro))
            .with_context(|| format!("the backward of {chunk}.{micro} before its forward"))?;
        let pieces = &self.chunks[chunk];
        let mut dy = match pieces.last() {
            Some(Piece::Head) => None,
            _ => Some(
                w.dys
                    .remove(&(chunk, micro))
                    .with_context(|| format!("no gradient for the backward of {chunk}.{micro}"))?,
            ),
        };
        let mut deferred = Vec::new();
        for (&p, (run, held)) in pieces.iter().zip(l.runs).rev() {
            hooks.before_backward(p, micro)?;
            let b = segment::backward(self.model, p, run, targets, dy.as_ref())?;
            w.held.add(&b.recomputed);
            w.held.remove(&b.recomputed);
            if self.split && matches!(p, Piece::Block(_)) {
                // The projections' weight gradients wait for the weight action as GEMM factors;
                // the norms' (reduced already, and views into their backward's buffers) are
                // added now.
                let (later, now): (Vec<_>, Vec<_>) =
                    b.grads.into_iter().partition(|(_, g)| g.is_product());
                let later = compact(later)?;
                let later_params: Vec<usize> = later.iter().map(|(i, _)| *i).collect();
                let mut now_params = self.model.piece_params(p);
                now_params.retain(|i| !later_params.contains(i));
                let tensors: Vec<&Tensor> = later.iter().flat_map(|(_, g)| g.tensors()).collect();
                let kept = segment::storages(&tensors);
                // What stays of the tape: the factors (their inputs are its storages). The
                // backward's own temporaries are not counted, split or not.
                w.held.remove(&held);
                w.held.add(&kept);
                self.finish(p, micro, (&now_params, now), grads, hooks, &mut w.tracked)?;
                hooks.after_backward(p, micro)?;
                finality.accumulated(&now_params, hooks)?;
                deferred.push(Deferred {
                    piece: p,
                    params: later_params,
                    grads: later,
                    held: kept,
                });
            } else {
                w.held.remove(&held);
                let params = self.model.piece_params(p);
                self.finish(p, micro, (&params, b.grads), grads, hooks, &mut w.tracked)?;
                hooks.after_backward(p, micro)?;
                finality.accumulated(&params, hooks)?;
            }
            w.tracked += b.dx.as_ref().map_or(0, |dx| segment::tracked(&[dx]));
            dy = b.dx;
        }
        if self.split {
            w.deferred.insert((chunk, micro), deferred);
        }
        match (self.local_neighbour(chunk, -1), dy) {
            (Some(prev), Some(dy)) => {
                w.dys.insert((prev, micro), dy); // handed to this stage's previous chunk
            }
            (_, dy) => {
                let state = Live {
                    runs: vec![],
                    output: None,
                    input_grad: dy,
                };
                w.live.insert((chunk, micro), state);
            }
        }
        Ok(())
    }

    /// The local chunk on this stage holding the global chunk `step` (±1) away from local
    /// `chunk`, if there is one (only the V placement's turn hands over within a stage).
    fn local_neighbour(&self, chunk: usize, step: isize) -> Option<usize> {
        let s = self.schedule;
        let g = s.global_chunk(self.stage, chunk).checked_add_signed(step)?;
        let (stage, local) = (g < s.num_chunks()).then(|| s.locate(g))?;
        (stage == self.stage).then_some(local)
    }

    /// The weight action of a split backward of (`chunk`, `micro`): the blocks' weight
    /// gradients its backward left, added into `grads` in the order the backward made them.
    fn weight(
        &self,
        chunk: usize,
        micro: usize,
        grads: &GradBuffer,
        hooks: &mut dyn StepHooks,
        finality: &mut Finality,
        w: &mut Walk,
    ) -> Result<()> {
        let deferred = w
            .deferred
            .remove(&(chunk, micro))
            .with_context(|| format!("the weight action of {chunk}.{micro} before its backward"))?;
        for d in deferred {
            let got = (&d.params[..], d.grads);
            self.finish(d.piece, micro, got, grads, hooks, &mut w.tracked)?;
            finality.accumulated(&d.params, hooks)?;
            w.held.remove(&d.held);
        }
        Ok(())
    }

    /// Adds the gradients `got` of piece `p`'s parameters `params` into `grads` and lets the
    /// hooks take what is staged.
    fn finish(
        &self,
        p: Piece,
        micro: usize,
        (params, got): (&[usize], Vec<(usize, ParamGrad)>),
        grads: &GradBuffer,
        hooks: &mut dyn StepHooks,
        tracked: &mut usize,
    ) -> Result<()> {
        self.accumulate(p, params, got, grads, tracked)?;
        hooks.after_accumulate(p, micro)
    }

    /// Adds piece `p`'s parameter gradients into `grads` (every parameter in `params` must have
    /// one, but an expert no token of the micro-batch chose).
    fn accumulate(
        &self,
        p: Piece,
        params: &[usize],
        got: Vec<(usize, ParamGrad)>,
        grads: &GradBuffer,
        tracked: &mut usize,
    ) -> Result<()> {
        let model = self.model;
        let mut got: HashMap<usize, ParamGrad> = got.into_iter().collect();
        for &i in params {
            let param = model.params().get(i);
            let Some(g) = got.remove(&i) else {
                if model.inventory().is_expert(i) {
                    continue; // no token of this micro-batch chose the expert
                }
                bail!("parameter {} received no gradient in {p:?}", param.name);
            };
            *tracked += segment::tracked(&g.tensors());
            match g {
                ParamGrad::Tensor(g) => grads.accumulate(i, &g),
                ParamGrad::Product { g, x } => grads.accumulate_product(i, &g, &x),
                ParamGrad::Fp8Product { g, x } => grads.accumulate_fp8_product(i, &g, &x),
            }
            .with_context(|| format!("accumulating the gradient of {}", param.name))?;
        }
        Ok(())
    }

    fn recv(&self, from: usize) -> Result<Tensor> {
        Ok(self
            .comm
            .recv(self.stage_ranks[from], &self.act_shape, self.dtype)?)
    }
}

/// Forward-only pass of one batch through the pipeline of `ctx`, chunk by chunk, activations
/// handed from stage to stage (no tapes kept, no gradients), with `hooks` around each piece's
/// forward (micro-batch 0). Returns the per-position losses `[b * s]` on the stage holding the
/// head, `None` elsewhere.
pub fn forward_losses(
    model: &Llama,
    ctx: &RankCtx,
    (tokens, labels, documents): (&Tensor, &Tensor, Option<&DocumentStarts>),
    hooks: &mut dyn StepHooks,
) -> Result<Option<Tensor>> {
    let (pp, stage) = (ctx.groups.pp.size(), ctx.coords.pp);
    let place = ctx.chunk_placement();
    let ranks = ctx.groups.pp.ranks();
    let (b, s) = tokens.dims2()?;
    let cfg = model.config();
    let shape = ctx.activation_shape(b, s, cfg.hidden_size);
    let dtype = model.params().get(0).dtype;
    let chunks = ctx.chunks(cfg.num_hidden_layers);
    let last = pp * chunks.len() - 1;
    // What a chunk hands to this stage's next chunk (a V's turn).
    let mut handed: Option<Tensor> = None;
    for (c, pieces) in chunks.into_iter().enumerate() {
        let g = place.global(pp, stage, c);
        let mut x = match (g, handed.take()) {
            (0, _) => tokens.clone(),
            (_, Some(x)) => x,
            _ => ctx
                .comm
                .recv(ranks[place.locate(pp, g - 1).0], &shape, dtype)?,
        };
        for p in pieces {
            hooks.before_forward(p, 0)?;
            let y = model.eval_forward(p, &x, labels, documents)?;
            hooks.after_forward(p, 0)?;
            if p == Piece::Head {
                return Ok(Some(y));
            }
            x = y;
        }
        match place.locate(pp, (g + 1).min(last)).0 {
            next if next == stage => handed = Some(x),
            next => ctx.comm.send(&x, ranks[next])?,
        }
    }
    Ok(None)
}
