//! The step executor: every rank's forward and backward passes of a training step, pipelined or
//! not. A rank runs its action list of a pipeline [`Schedule`] — forward and backward of its model
//! chunks per micro-batch, and the sends and receives of activations and gradients around them —
//! over the segment mechanism, adding each piece's parameter gradients into the flat buffer right
//! after that piece's backward. A rank without pipeline parallelism runs a one-stage schedule
//! (forward then backward of each micro-batch), so there is one step path for every layout.
//!
//! The parallelisms that act around pieces hook in through [`StepHooks`] (`hooks.rs`). Point-to-
//! point channels carry no tags; schedules are checked with `parallel::pipeline::check_fifo`
//! before use. Also here: the forward-only pass of evaluation ([`forward_losses`]).

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Shape, Tensor};
use data::Batch;
use model::segment::{self, ParamGrad, Pass, SegmentRun};
use model::{BackwardMode, Llama, Piece, Recompute, Targets};
use parallel::pipeline::{Action, Schedule};
use parallel::Comm;

use super::hooks::StepHooks;
use super::RankCtx;
use crate::optim::GradBuffer;

/// The tensors of one micro-batch on the compute device.
pub struct MicroBatch {
    /// `[b, s]` u32 input ids.
    pub tokens: Tensor,
    /// Labels, mask and loss scale for the head.
    pub targets: Targets,
}

impl MicroBatch {
    /// Moves a data batch to `device`; `loss_scale` is 1 / counted tokens of the global batch,
    /// `aux_scale` 1 / micro-batches of the global batch (see [`Targets`]).
    pub fn new(b: &Batch, loss_scale: f64, aux_scale: f64, device: &Device) -> Result<Self> {
        Ok(Staged::new(b, device)?.into_micro_batch(loss_scale, aux_scale))
    }
}

/// A micro-batch already on the compute device whose loss scales are not known yet (they need
/// the token count of the whole global batch, an all-reduce the training thread does). The data
/// prefetch thread makes these, so the host-to-device copies of the next step's batches are
/// enqueued while this step computes and never on the training thread's path.
pub struct Staged {
    /// `[b, s]` u32 input ids.
    tokens: Tensor,
    /// `[b·s]` u32 labels.
    labels: Tensor,
    /// `[b·s]` f32 loss mask.
    loss_mask: Tensor,
    /// The number of counted tokens (the loss mask's sum, read on the host before the copy).
    pub counted: f64,
}

impl Staged {
    /// Copies a data batch to `device`.
    pub fn new(b: &Batch, device: &Device) -> Result<Self> {
        let n = b.micro_batch * b.seq_len;
        Ok(Self {
            tokens: Tensor::from_slice(&b.tokens, (b.micro_batch, b.seq_len), device)?,
            labels: Tensor::from_slice(&b.labels, n, device)?,
            loss_mask: Tensor::from_slice(&b.loss_mask, n, device)?,
            counted: b.loss_mask.iter().map(|&m| m as f64).sum(),
        })
    }

    /// The micro-batch with its loss scales (see [`MicroBatch::new`]).
    pub fn into_micro_batch(self, loss_scale: f64, aux_scale: f64) -> MicroBatch {
        MicroBatch {
            tokens: self.tokens,
            targets: Targets {
                labels: self.labels,
                loss_mask: self.loss_mask,
                loss_scale,
                aux_scale,
            },
        }
    }
}

/// One timed action of a step.
#[derive(Debug, Clone)]
pub struct Timed {
    /// The action.
    pub action: Action,
    /// Start, seconds since the step began.
    pub start: f64,
    /// End, seconds since the step began.
    pub end: f64,
}

/// What a rank's run of a step produced (its gradients are in the gradient buffer).
pub struct StepRun {
    /// The summed scaled loss of the micro-batches whose head is on this rank (0 elsewhere).
    pub loss: f64,
    /// Every action with its start and end.
    pub timing: Vec<Timed>,
    /// Peak bytes of activations kept for backward passes (see [`Activations`]).
    pub act_peak_bytes: usize,
}

/// The activation memory of a rank's step: the distinct storages kept by its segments between
/// their forward and backward passes (graphs, or only inputs under recompute), plus the graph a
/// recomputing backward rebuilds while it runs. Parameters are not counted; a storage shared by
/// two segments (one's output is the next one's input) counts once.
#[derive(Default)]
struct Activations {
    /// Bytes and holders of each live storage.
    live: HashMap<usize, (usize, usize)>,
    bytes: usize,
    peak: usize,
}

impl Activations {
    fn add(&mut self, held: &segment::Held) {
        for &(key, bytes) in held {
            let e = self.live.entry(key).or_insert((0, 0));
            if bytes > e.0 {
                self.bytes += bytes - e.0;
                e.0 = bytes;
            }
            e.1 += 1;
        }
        self.peak = self.peak.max(self.bytes);
    }

    fn remove(&mut self, held: &segment::Held) {
        for (key, _) in held {
            if let Some(e) = self.live.get_mut(key) {
                e.1 -= 1;
                if e.1 == 0 {
                    self.bytes -= e.0;
                    self.live.remove(key);
                }
            }
        }
    }
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
    /// Hand-written backward passes where a piece has one, or autograd for every piece.
    backward: BackwardMode,
    /// Time every action on this device's timeline (see [`Executor::timed_on_device`]).
    device_timed: Option<&'a Device>,
}

/// How piece `p` runs: with its hand-written backward (a decoder block, the head with `targets`)
/// when `hand_written` allows and the model has one for it, else through the autograd graph of
/// `graph`.
fn pass_of<'g>(
    model: &'g Llama,
    p: Piece,
    hand_written: bool,
    graph: &'g dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    targets: &'g Targets,
) -> Pass<'g> {
    match p {
        Piece::Block(i) if hand_written && model.hand_written(p) => {
            Pass::Block(model, i, targets.aux_scale)
        }
        Piece::Head if hand_written && model.hand_written(p) => Pass::Head(model, targets),
        _ => Pass::Graph(graph),
    }
}

/// What a (chunk, micro-batch) keeps between its forward and its backward.
struct Live {
    runs: Vec<(SegmentRun, segment::Held)>,
    output: Option<Tensor>,
    input_grad: Option<Tensor>,
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
        let sp_split = if ctx.sequence_parallel {
            ctx.tp.size()
        } else {
            1
        };
        let cfg = model.config();
        Self {
            model,
            schedule,
            comm: ctx.comm.as_ref(),
            stage: ctx.coords.pp,
            stage_ranks: ctx.pp.ranks(),
            chunks: ctx.chunks(cfg.num_hidden_layers),
            act_shape: Shape::from((micro_batch, seq_len / sp_split, cfg.hidden_size)),
            dtype: model.params().get(0).dtype,
            recompute,
            backward: BackwardMode::default(),
            device_timed: None,
        }
    }

    /// Runs the pieces' backward passes as `kind` says (hand-written where a piece has one, by
    /// default).
    pub fn with_backward(mut self, kind: BackwardMode) -> Self {
        self.backward = kind;
        self
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
        let model = self.model;
        let mode = |p: Piece| self.recompute.for_piece(p);
        let run_piece = |p: Piece, micro: usize| {
            let targets = &mbs[micro].targets;
            move |x: &Tensor| model.piece_forward(p, x, targets)
        };
        let hand_written = self.backward == BackwardMode::HandWritten;
        // Backward passes still to come that add to each parameter; it is final at zero.
        let mut pending = vec![0usize; model.params().len()];
        for &p in self.chunks.iter().flatten() {
            for i in model.piece_params(p) {
                pending[i] += mbs.len();
            }
        }
        let (mut live, mut acts, mut dys): (
            HashMap<_, Live>,
            HashMap<_, Tensor>,
            HashMap<_, Tensor>,
        ) = Default::default();
        let actions = &self.schedule.actions[self.stage];
        // The micro-batches' losses are summed where they are computed (f64, in schedule order)
        // and read once at the end: no host wait per micro-batch on a GPU.
        let (mut loss, mut timing): (Option<Tensor>, _) = (None, Vec::with_capacity(actions.len()));
        let mut acts_held = Activations::default();
        let device_clock = self
            .device_timed
            .map(|d| super::clock::StepClock::new(d, clock))
            .transpose()?;
        let mut marks = Vec::new();
        for &action in actions {
            let t0 = clock.elapsed().as_secs_f64();
            let m0 = device_clock.as_ref().map(|c| c.mark()).transpose()?;
            match action {
                Action::RecvActivation { chunk, micro, from } => {
                    acts.insert((chunk, micro), self.recv(from)?);
                }
                Action::RecvGrad { chunk, micro, from } => {
                    dys.insert((chunk, micro), self.recv(from)?);
                }
                Action::Forward { chunk, micro } => {
                    let pieces = &self.chunks[chunk];
                    let mut x = match pieces.first() {
                        Some(Piece::Embedding) => mbs[micro].tokens.clone(),
                        _ => acts
                            .remove(&(chunk, micro))
                            .with_context(|| format!("no activation for {action}"))?,
                    };
                    let mut runs = Vec::with_capacity(pieces.len());
                    for &p in pieces {
                        hooks.before_forward(p, micro)?;
                        let graph = run_piece(p, micro);
                        let (y, run) = segment::forward(
                            &pass_of(model, p, hand_written, &graph, &mbs[micro].targets),
                            &x,
                            p != Piece::Embedding,
                            mode(p),
                        )?;
                        hooks.after_forward(p, micro)?;
                        let held = run.held();
                        acts_held.add(&held);
                        runs.push((run, held));
                        x = y;
                    }
                    let output = if pieces.last() == Some(&Piece::Head) {
                        // Detached: the sum must not keep this micro-batch's graph alive.
                        let x = x.detach().to_dtype(DType::F64)?;
                        loss = Some(match loss {
                            Some(sum) => (sum + x)?,
                            None => x,
                        });
                        None
                    } else {
                        Some(x)
                    };
                    let state = Live {
                        runs,
                        output,
                        input_grad: None,
                    };
                    live.insert((chunk, micro), state);
                }
                Action::SendActivation { chunk, micro, to } => {
                    let out = live.get_mut(&(chunk, micro)).and_then(|l| l.output.take());
                    let out = out.with_context(|| format!("nothing to send for {action}"))?;
                    self.comm.send(&out, self.stage_ranks[to])?;
                }
                Action::Backward { chunk, micro } => {
                    let l = live
                        .remove(&(chunk, micro))
                        .with_context(|| format!("{action} before its forward"))?;
                    let pieces = &self.chunks[chunk];
                    let mut dy = match pieces.last() {
                        Some(Piece::Head) => None,
                        _ => Some(
                            dys.remove(&(chunk, micro))
                                .with_context(|| format!("no gradient for {action}"))?,
                        ),
                    };
                    for (&p, (run, held)) in pieces.iter().zip(l.runs).rev() {
                        hooks.before_backward(p, micro)?;
                        let graph = run_piece(p, micro);
                        let segment::Backward {
                            grads: mut store,
                            dx,
                            recomputed,
                        } = segment::backward(
                            &pass_of(model, p, hand_written, &graph, &mbs[micro].targets),
                            run,
                            p != Piece::Embedding,
                            dy.as_ref(),
                        )?;
                        acts_held.add(&recomputed);
                        acts_held.remove(&recomputed);
                        acts_held.remove(&held);
                        let params = model.piece_params(p);
                        for &i in &params {
                            let param = model.params().get(i);
                            let Some(g) = store.take(i, &param.tensor()?) else {
                                if model.inventory().is_expert(i) {
                                    continue; // no token of this micro-batch chose the expert
                                }
                                bail!("parameter {} received no gradient in {p:?}", param.name);
                            };
                            match g {
                                ParamGrad::Tensor(g) => grads.accumulate(i, &g),
                                ParamGrad::Product { g, x } => grads.accumulate_product(i, &g, &x),
                            }
                            .with_context(|| {
                                format!("accumulating the gradient of {}", param.name)
                            })?;
                        }
                        hooks.after_backward(p, micro)?;
                        for i in params {
                            pending[i] -= 1;
                            if pending[i] == 0 {
                                hooks.param_final(i)?;
                            }
                        }
                        dy = dx;
                    }
                    let state = Live {
                        runs: vec![],
                        output: None,
                        input_grad: dy,
                    };
                    live.insert((chunk, micro), state);
                }
                Action::SendGrad { chunk, micro, to } => {
                    let g = live.remove(&(chunk, micro)).and_then(|l| l.input_grad);
                    let g = g.with_context(|| format!("no input gradient for {action}"))?;
                    self.comm.send(&g, self.stage_ranks[to])?;
                }
            }
            match (&device_clock, m0) {
                (Some(c), Some(m0)) => marks.push((action, m0, c.mark()?)),
                _ => timing.push(Timed {
                    action,
                    start: t0,
                    end: clock.elapsed().as_secs_f64(),
                }),
            }
        }
        let loss = loss.map_or(Ok(0.0), |l| l.to_scalar::<f64>())?;
        if let Some(c) = &device_clock {
            for (action, a, b) in marks {
                timing.push(Timed {
                    action,
                    start: c.seconds(&a)?,
                    end: c.seconds(&b)?,
                });
            }
        }
        Ok(StepRun {
            loss,
            timing,
            act_peak_bytes: acts_held.peak,
        })
    }

    fn recv(&self, from: usize) -> Result<Tensor> {
        Ok(self
            .comm
            .recv(self.stage_ranks[from], &self.act_shape, self.dtype)?)
    }
}

/// Forward-only pass of one batch through the pipeline of `ctx`, chunk by chunk, activations
/// handed from stage to stage (no segments, no gradients), with `hooks` around each piece's
/// forward (micro-batch 0). Returns the per-position losses `[b * s]` on the last stage, `None`
/// elsewhere.
pub fn forward_losses(
    model: &Llama,
    ctx: &RankCtx,
    tokens: &Tensor,
    labels: &Tensor,
    hooks: &mut dyn StepHooks,
) -> Result<Option<Tensor>> {
    let (pp, stage) = (ctx.pp.size(), ctx.coords.pp);
    let ranks = ctx.pp.ranks();
    let (b, s) = tokens.dims2()?;
    let sp_split = if ctx.sequence_parallel {
        ctx.tp.size()
    } else {
        1
    };
    let cfg = model.config();
    let shape = Shape::from((b, s / sp_split, cfg.hidden_size));
    let dtype = model.params().get(0).dtype;
    for (c, pieces) in ctx.chunks(cfg.num_hidden_layers).into_iter().enumerate() {
        let g = c * pp + stage; // global chunk
        let mut x = if g == 0 {
            tokens.clone()
        } else {
            ctx.comm.recv(ranks[(g - 1) % pp], &shape, dtype)?
        };
        for p in pieces {
            hooks.before_forward(p, 0)?;
            let y = match p {
                Piece::Embedding => model.embed(&x)?,
                Piece::Block(i) => model.block(i, &x)?,
                Piece::Head => model.losses(&x, labels)?,
            };
            hooks.after_forward(p, 0)?;
            if p == Piece::Head {
                return Ok(Some(y));
            }
            x = y;
        }
        ctx.comm.send(&x.detach(), ranks[(g + 1) % pp])?;
    }
    Ok(None)
}
