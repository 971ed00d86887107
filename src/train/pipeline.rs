//! The pipeline executor: runs this rank's action list of a [`Schedule`] (forward / backward of a
//! model chunk for a micro-batch, sends and receives of activations and gradients) over the
//! segment mechanism, accumulating gradients, and times every action for the timeline trace.
//!
//! Point-to-point channels carry no tags (as with NCCL): a message is matched to a receive by its
//! position in the channel. [`fifo_consistent`] checks that every channel's send order equals its
//! receive order before a schedule is used.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Shape, Tensor};
use model::{segment, segment::SegmentRun, Llama, Piece, Recompute};
use parallel::pipeline::{chrome_trace, Action, Schedule, TraceSpan};
use parallel::Group;

use super::step::MicroBatch;
use super::RankCtx;
use crate::optim::GradBuffer;

/// The pieces of local chunk `c` of pipeline stage `stage`: global chunk `c · pp + stage` holds
/// `layers_per_chunk` consecutive layers, the embedding if it is the first global chunk and the
/// head if it is the last.
pub fn chunk_pieces(stage: usize, c: usize, pp: usize, v: usize, num_layers: usize) -> Vec<Piece> {
    let g = c * pp + stage;
    let per = num_layers / (pp * v);
    let mut pieces = Vec::new();
    if g == 0 {
        pieces.push(Piece::Embedding);
    }
    pieces.extend((g * per..(g + 1) * per).map(Piece::Block));
    if g + 1 == pp * v {
        pieces.push(Piece::Head);
    }
    pieces
}

/// Whether, for every ordered pair of stages, the sender's sends and the receiver's receives
/// name the same messages in the same order.
pub fn fifo_consistent(s: &Schedule) -> Result<()> {
    type Msg = (bool, usize, usize); // (is gradient, global chunk of the consumer side, micro)
    let mut sent: HashMap<(usize, usize), Vec<Msg>> = HashMap::new();
    let mut recv: HashMap<(usize, usize), Vec<Msg>> = HashMap::new();
    for (st, actions) in s.actions.iter().enumerate() {
        for a in actions {
            match *a {
                // An activation of global chunk g feeds chunk g + 1; a gradient of g feeds g - 1.
                Action::SendActivation { chunk, micro, to } => sent
                    .entry((st, to))
                    .or_default()
                    .push((false, s.global_chunk(st, chunk) + 1, micro)),
                Action::RecvActivation { chunk, micro, from } => recv
                    .entry((from, st))
                    .or_default()
                    .push((false, s.global_chunk(st, chunk), micro)),
                Action::SendGrad { chunk, micro, to } => sent.entry((st, to)).or_default().push((
                    true,
                    s.global_chunk(st, chunk) - 1,
                    micro,
                )),
                Action::RecvGrad { chunk, micro, from } => recv
                    .entry((from, st))
                    .or_default()
                    .push((true, s.global_chunk(st, chunk), micro)),
                _ => {}
            }
        }
    }
    for ch in sent.keys().chain(recv.keys()) {
        let (out, inn) = (sent.get(ch), recv.get(ch));
        if out != inn {
            bail!(
                "pipeline schedule: channel {} -> {} sends {:?} but receives {:?}",
                ch.0,
                ch.1,
                out,
                inn
            );
        }
    }
    Ok(())
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

/// What one rank's run of a schedule needs.
pub struct Executor<'a> {
    /// This rank's part of the model.
    pub model: &'a Llama,
    /// The step's schedule.
    pub schedule: &'a Schedule,
    /// This rank's pipeline stage.
    pub stage: usize,
    /// Global rank of each pipeline stage in this rank's pipeline group.
    pub stage_ranks: Vec<usize>,
    /// The communicator.
    pub comm: &'a dyn parallel::Comm,
    /// Shape of the activations between chunks, `[b, s (/ tp with sequence parallelism), h]`.
    pub act_shape: Shape,
    /// Their dtype.
    pub dtype: DType,
    /// Activation recompute of decoder blocks.
    pub recompute: Recompute,
}

struct Live {
    runs: Vec<SegmentRun>,
    output: Option<Tensor>,
    input_grad: Option<Tensor>,
}

impl Executor<'_> {
    /// Runs the schedule for `mbs` (one per micro-batch), adding gradients into `grads`. Returns the
    /// summed scaled loss of the micro-batches whose head is on this rank and the timed actions.
    pub fn run(
        &self,
        mbs: &[MicroBatch],
        grads: &GradBuffer,
        start: Instant,
    ) -> Result<(f64, Vec<Timed>)> {
        let (pp, v) = (self.schedule.pp, self.schedule.v);
        let layers = self.model.config().num_hidden_layers;
        let chunks: Vec<Vec<Piece>> = (0..v)
            .map(|c| chunk_pieces(self.stage, c, pp, v, layers))
            .collect();
        let mode = |p: Piece| self.recompute.for_piece(p);
        let run_piece = |p: Piece, micro: usize| {
            let targets = &mbs[micro].targets;
            move |x: &Tensor| self.model.piece_forward(p, x, targets)
        };
        let (mut live, mut acts, mut dys): (
            HashMap<_, Live>,
            HashMap<_, Tensor>,
            HashMap<_, Tensor>,
        ) = Default::default();
        let (mut loss, mut timed) = (
            0.0,
            Vec::with_capacity(self.schedule.actions[self.stage].len()),
        );
        for &action in &self.schedule.actions[self.stage] {
            let t0 = start.elapsed().as_secs_f64();
            match action {
                Action::RecvActivation { chunk, micro, from } => {
                    let t = self
                        .comm
                        .recv(self.stage_ranks[from], &self.act_shape, self.dtype)?;
                    acts.insert((chunk, micro), t);
                }
                Action::RecvGrad { chunk, micro, from } => {
                    let t = self
                        .comm
                        .recv(self.stage_ranks[from], &self.act_shape, self.dtype)?;
                    dys.insert((chunk, micro), t);
                }
                Action::Forward { chunk, micro } => {
                    let mut x = match chunks[chunk].first() {
                        Some(Piece::Embedding) => mbs[micro].tokens.clone(),
                        _ => acts
                            .remove(&(chunk, micro))
                            .with_context(|| format!("no activation for {action}"))?,
                    };
                    let mut runs = Vec::with_capacity(chunks[chunk].len());
                    for &p in &chunks[chunk] {
                        let (y, run) = segment::forward(
                            &run_piece(p, micro),
                            &x,
                            p != Piece::Embedding,
                            mode(p),
                        )?;
                        runs.push(run);
                        x = y;
                    }
                    let output = if chunks[chunk].last() == Some(&Piece::Head) {
                        loss += x.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                        None
                    } else {
                        Some(x)
                    };
                    live.insert(
                        (chunk, micro),
                        Live {
                            runs,
                            output,
                            input_grad: None,
                        },
                    );
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
                    let mut dy = match chunks[chunk].last() {
                        Some(Piece::Head) => None,
                        _ => Some(
                            dys.remove(&(chunk, micro))
                                .with_context(|| format!("no gradient for {action}"))?,
                        ),
                    };
                    for (&p, run) in chunks[chunk].iter().zip(l.runs).rev() {
                        let (store, dx) = segment::backward(
                            &run_piece(p, micro),
                            run,
                            p != Piece::Embedding,
                            dy.as_ref(),
                        )?;
                        for i in self.model.piece_params(p) {
                            let param = self.model.params().get(i);
                            let g = store.get(param.var.as_tensor());
                            let g = g.with_context(|| {
                                format!("parameter {} received no gradient", param.name)
                            })?;
                            grads.accumulate(i, g)?;
                        }
                        dy = dx;
                    }
                    live.insert(
                        (chunk, micro),
                        Live {
                            runs: vec![],
                            output: None,
                            input_grad: dy,
                        },
                    );
                }
                Action::SendGrad { chunk, micro, to } => {
                    let g = live.remove(&(chunk, micro)).and_then(|l| l.input_grad);
                    let g = g.with_context(|| format!("no input gradient for {action}"))?;
                    self.comm.send(&g, self.stage_ranks[to])?;
                }
            }
            timed.push(Timed {
                action,
                start: t0,
                end: start.elapsed().as_secs_f64(),
            });
        }
        Ok((loss, timed))
    }
}

/// Forward-only pass of one micro-batch through the pipeline of `ctx`: chunk by chunk, activations
/// handed from stage to stage. Returns the per-position losses on the last stage, `None` elsewhere.
pub fn pipeline_losses(
    model: &Llama,
    ctx: &RankCtx,
    tokens: &Tensor,
    labels: &Tensor,
) -> Result<Option<Tensor>> {
    let (pp, v, stage) = (ctx.pp.size(), ctx.virtual_stages, ctx.coords.pp);
    let ranks = ctx.pp.ranks();
    let (b, s) = tokens.dims2()?;
    let sp_split = if ctx.sequence_parallel {
        ctx.tp.size()
    } else {
        1
    };
    let cfg = model.config();
    let shape = Shape::from((b, s / sp_split, cfg.hidden_size));
    let dtype = model.params().get(0).var.dtype();
    for g in 0..pp * v {
        if g % pp != stage {
            continue;
        }
        let mut x = if g == 0 {
            tokens.clone()
        } else {
            ctx.comm.recv(ranks[(g - 1) % pp], &shape, dtype)?
        };
        for p in chunk_pieces(stage, g / pp, pp, v, cfg.num_hidden_layers) {
            x = match p {
                Piece::Embedding => model.embed(&x)?,
                Piece::Block(i) => model.block(i, &x)?,
                Piece::Head => return Ok(Some(model.losses(&x, labels)?)),
            };
        }
        ctx.comm.send(&x.detach(), ranks[(g + 1) % pp])?;
    }
    Ok(None)
}

impl super::Trainer {
    /// One step's forward and backward through the pipeline schedule; returns this rank's part of
    /// the loss (non-zero only on the last stage).
    pub(super) fn pipelined(
        &mut self,
        batches: &[data::Batch],
        scale: f64,
        start: Instant,
    ) -> Result<f64> {
        let ctx = &self.ctx;
        let schedule = self
            .schedule
            .as_ref()
            .expect("pipelined steps have a schedule");
        let mbs = batches
            .iter()
            .map(|b| MicroBatch::new(b, scale, &self.device))
            .collect::<Result<Vec<_>>>()?;
        let sp_split = if ctx.sequence_parallel {
            ctx.tp.size()
        } else {
            1
        };
        let h = self.recipe.model.hidden_size;
        let exec = Executor {
            model: &self.model,
            schedule,
            stage: ctx.coords.pp,
            stage_ranks: ctx.pp.ranks().to_vec(),
            comm: ctx.comm.as_ref(),
            act_shape: Shape::from((
                self.recipe.train.micro_batch,
                self.recipe.train.seq_len / sp_split,
                h,
            )),
            dtype: self.model.params().get(0).var.dtype(),
            recompute: self.recipe.train.recompute,
        };
        if let Some(s) = &mut self.sync {
            s.start();
        }
        let (loss, timed) = exec.run(&mbs, &self.grads, start)?;
        self.timing = timed;
        // Tied embeddings: the first stage's embedding and the last stage's copy get the sum.
        if let (true, Some(i)) = (
            self.recipe.model.tie_word_embeddings,
            self.model.params().index_of("model.embed_tokens.weight"),
        ) {
            let g = ctx.comm.all_reduce(
                &ctx.embedding_group(),
                &self.grads.get(i)?,
                parallel::ReduceOp::Sum,
            )?;
            self.grads.set(i, &g)?;
        }
        for i in 0..self.model.params().len() {
            super::reduce_replicated(ctx, &self.model, &self.grads, i)?;
            if let Some(s) = &mut self.sync {
                s.ready(i)?;
            }
        }
        if let Some(s) = &mut self.sync {
            s.finish()
                .context("synchronising gradients across data-parallel ranks")?;
        }
        Ok(loss)
    }

    /// Writes the last pipelined step's timeline (every rank, every action, plus the optimizer) as
    /// a Chrome/Perfetto trace to `<run.dir>/trace.json` and returns the measured bubble fraction
    /// (mean over ranks of the idle share of the pipeline phase).
    pub(super) fn write_trace(&self, optimizer: (f64, f64)) -> Result<Option<f64>> {
        let Some(schedule) = &self.schedule else {
            return Ok(None);
        };
        let ctx = &self.ctx;
        let mine: Vec<f64> = self
            .timing
            .iter()
            .flat_map(|t| [t.start, t.end])
            .chain([optimizer.0, optimizer.1])
            .collect();
        let world = ctx.mesh.world_size();
        // One all-gather of every rank's times (padded to the longest stage) instead of one
        // transfer per rank into rank 0.
        let width = 2 * schedule.actions.iter().map(Vec::len).max().unwrap_or(0) + 2;
        let mut row = mine;
        row.resize(width, 0.0);
        let everyone = Group::new((0..world).collect());
        let all = ctx
            .comm
            .all_gather(
                &everyone,
                &Tensor::from_vec(row, (1, width), &Device::Cpu)?,
                0,
            )?
            .to_vec2::<f64>()?; // [world, width]
        if !ctx.is_main() {
            return Ok(None);
        }
        let (mut spans, mut bubbles) = (Vec::new(), Vec::new());
        for (rank, times) in all.iter().enumerate() {
            let stage = ctx.mesh.coords(rank).pp;
            let actions = &schedule.actions[stage];
            let (mut busy, mut window) = (0.0, 0.0f64);
            for (k, a) in actions.iter().enumerate() {
                let (s, e) = (times[2 * k], times[2 * k + 1]);
                if a.is_compute() {
                    busy += e - s;
                }
                window = window.max(e);
                spans.push(TraceSpan {
                    stage: rank,
                    name: a.to_string(),
                    start_us: s * 1e6,
                    dur_us: (e - s) * 1e6,
                });
            }
            let (s, e) = (times[2 * actions.len()], times[2 * actions.len() + 1]);
            spans.push(TraceSpan {
                stage: rank,
                name: "optimizer".into(),
                start_us: s * 1e6,
                dur_us: (e - s) * 1e6,
            });
            bubbles.push(1.0 - busy / window.max(1e-12));
        }
        let path = self.recipe.run.dir.join("trace.json");
        std::fs::create_dir_all(&self.recipe.run.dir)?;
        std::fs::write(&path, chrome_trace(&spans))
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(Some(bubbles.iter().sum::<f64>() / bubbles.len() as f64))
    }
}
