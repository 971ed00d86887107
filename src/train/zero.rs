//! ZeRO around the model's pieces: a rank's gradient and optimizer state by stage, and the
//! stage-3 [`Gatherer`] that installs a piece's full parameters for its forward and backward.
//!
//! **Buckets.** Stages 0 and 1 cut the flat buffer into buckets by size (`parallel.bucket_size`),
//! for overlapped data-parallel reduction. Stages 2 and 3 reduce-scatter (and gather) per model
//! piece, so a bucket is a run of consecutive parameters first used by the same piece
//! ([`unit_buckets`]): the embedding, each decoder block, the final norm with an untied output
//! matrix. A piece that also reads another piece's parameter (the tied output matrix is the
//! embedding) needs that bucket too.
//!
//! **Stage 3 across micro-batches.** A piece's buckets are gathered before its forward and, under
//! activation recompute, again before its backward, and released after each. Without recompute
//! candle's autograd graph keeps every tensor a forward used until that piece's backward, so
//! releasing the parameters after the forward would free nothing: they stay installed until the
//! backward of the last micro-batch whose forward used them (with pipelining, across the
//! micro-batches in flight — what PyTorch does with pipelines). With recompute, at most the
//! current piece's buckets and the next piece's (gathered ahead on the communication thread)
//! are live.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use model::{Inventory, Llama, ParamKind, Piece, Recompute};
use parallel::comm::thread::Ticket;
use parallel::dp::{
    gather_shards, owned_ranges, DataParallel, DpGroups, FlatLayout, Partial, ShardPos,
};
use parallel::pipeline::{Action, Schedule};
use parallel::tp::Shard;
use parallel::ParallelConfig;

use super::metrics::StateBytes;
use super::RankCtx;
use crate::optim::{flatten_params, write_params, AdamW, GradBuffer};
use crate::recipe::Recipe;

/// The buckets of ZeRO stages 2 and 3: runs of consecutive parameters first used by the same
/// piece (pieces in `chunks` order) of the part `inventory` describes; with `split_experts`,
/// a piece's routed experts form a bucket of their own (they are sharded over another group).
pub fn unit_buckets(
    inventory: &Inventory,
    chunks: &[Vec<Piece>],
    split_experts: bool,
) -> Vec<Range<usize>> {
    let n = inventory.params.len();
    let mut owner = vec![usize::MAX; n];
    for (k, &p) in chunks.iter().flatten().enumerate() {
        for i in inventory.piece_params(p) {
            if owner[i] == usize::MAX {
                owner[i] = k;
            }
        }
    }
    let expert = inventory.expert_flags();
    let same_kind = |a: usize, b: usize| !split_experts || expert[a] == expert[b];
    let mut out: Vec<Range<usize>> = Vec::new();
    for i in 0..n {
        match out.last_mut() {
            Some(r) if owner[r.start] == owner[i] && same_kind(r.start, i) => r.end = i + 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

/// Where a rank's gradients and optimizer state live: the flat layout of its parameters
/// (`numels`, this part's local sizes in construction order) and the flat ranges it owns.
#[derive(Debug, Clone)]
pub struct StateLayout {
    /// Buckets by size (stages 0, 1) or by piece (2, 3), padded for the shard group.
    pub layout: FlatLayout,
    /// The flat ranges whose optimizer state (and, at stages 2 and 3, gradients) this rank keeps.
    pub owned: Vec<Range<usize>>,
}

impl StateLayout {
    /// The layout of a rank at data-parallel shard index `shard_index` (and `expert_index` in
    /// its expert gradient group) holding the part `inventory` (local sizes `numels`, pipeline
    /// chunks `chunks`) under `par`. With expert parallelism the routed experts' parameters
    /// get buckets of their own, sharded over the expert gradient group.
    pub fn new(
        par: &ParallelConfig,
        inventory: &Inventory,
        numels: &[usize],
        chunks: &[Vec<Piece>],
        shard_index: usize,
        expert_index: usize,
    ) -> Self {
        let (zero, shard) = (par.zero, par.shard_size());
        // Stage 0 pads buckets for the data-parallel size (as always); sharded stages for the
        // shard group.
        let (pad, expert_pad) = if zero == 0 {
            (par.dp, par.dp / par.ep)
        } else {
            (shard, par.expert_grad_ranks())
        };
        let split = par.ep > 1;
        let expert = if split {
            inventory.expert_flags()
        } else {
            vec![false; numels.len()]
        };
        let pads = [pad, expert_pad];
        let layout = if zero >= 2 {
            let buckets = unit_buckets(inventory, chunks, split);
            FlatLayout::with_grouped_buckets(numels, &buckets, &expert, pads)
        } else {
            FlatLayout::grouped(numels, &expert, par.bucket_size, pads)
        };
        let pos = ShardPos {
            dense: (shard_index, shard),
            expert: (expert_index, par.expert_grad_ranks()),
        };
        let owned = owned_ranges(&layout, zero >= 1, pos);
        Self { layout, owned }
    }

    /// Elements this rank owns.
    pub fn owned_elems(&self) -> usize {
        self.owned.iter().map(|r| r.len()).sum()
    }

    /// The bytes of parameters (in `dtype`), fp32 gradients and fp32 AdamW state (master weights
    /// and two moments) this layout gives a rank at ZeRO stage `zero`.
    pub fn bytes(&self, zero: u8, numels: &[usize], dtype: DType) -> StateBytes {
        let p = dtype.size_in_bytes();
        let owned = self.owned_elems();
        StateBytes {
            param_bytes: p * if zero >= 3 {
                owned
            } else {
                numels.iter().sum()
            },
            grad_bytes: 4 * if zero >= 2 { owned } else { self.layout.total },
            optimizer_bytes: 3 * 4 * owned,
        }
    }
}

/// Whether a piece's use is its forward or its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward.
    Forward,
    /// Backward (which re-runs the forward first under recompute).
    Backward,
}

/// The buckets holding piece `p`'s parameters, ascending.
pub fn piece_buckets(model: &Llama, layout: &FlatLayout, p: Piece) -> Vec<usize> {
    let mut b: Vec<usize> = model
        .piece_params(p)
        .into_iter()
        .map(|i| layout.bucket_of(i))
        .collect();
    b.sort_unstable();
    b.dedup();
    b
}

/// Every piece use of one stage's action list, in order: a forward runs a chunk's pieces first
/// to last, a backward last to first.
pub fn piece_uses(
    schedule: &Schedule,
    stage: usize,
    chunks: &[Vec<Piece>],
) -> Vec<(Piece, usize, Pass)> {
    let mut uses = Vec::new();
    for a in &schedule.actions[stage] {
        match *a {
            Action::Forward { chunk, micro } => {
                uses.extend(chunks[chunk].iter().map(|&p| (p, micro, Pass::Forward)));
            }
            Action::Backward { chunk, micro } => {
                uses.extend(
                    chunks[chunk]
                        .iter()
                        .rev()
                        .map(|&p| (p, micro, Pass::Backward)),
                );
            }
            _ => {}
        }
    }
    uses
}

/// What the stage-3 gathers of a step cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GatherStats {
    /// Seconds the communication thread spent all-gathering parameters.
    pub gather_s: f64,
    /// Seconds the compute thread waited for a gather.
    pub wait_s: f64,
    /// Most bytes of full parameters live at once (installed or gathered ahead).
    pub peak_bytes: usize,
}

/// ZeRO-3: installs the full parameters of the pieces being computed (see the module docs).
pub struct Gatherer {
    layout: FlatLayout,
    recompute: Recompute,
    /// Bytes per element of the training dtype.
    elem: usize,
    /// The buckets each piece reads.
    needs: HashMap<Piece, Vec<usize>>,
    /// The step's piece uses, for gathering one ahead.
    plan: Vec<(Piece, usize, Pass)>,
    next: usize,
    /// Whether this pass has no backward (evaluation): nothing is kept for one.
    forward_only: bool,
    /// Installed buckets, with the forwards still waiting for their backward.
    installed: HashMap<usize, usize>,
    /// Gathers submitted ahead of their use.
    ahead: HashMap<usize, Ticket<(Tensor, f64)>>,
    stats: GatherStats,
}

impl Gatherer {
    /// A gatherer for `model`'s parameters laid out by `layout`, pieces in `chunks`.
    pub fn new(
        model: &Llama,
        layout: FlatLayout,
        chunks: &[Vec<Piece>],
        recompute: Recompute,
    ) -> Self {
        let needs = chunks
            .iter()
            .flatten()
            .map(|&p| (p, piece_buckets(model, &layout, p)))
            .collect();
        let elem = model.params().get(0).dtype.size_in_bytes();
        Self {
            layout,
            recompute,
            elem,
            needs,
            plan: Vec::new(),
            next: 0,
            forward_only: false,
            installed: HashMap::new(),
            ahead: HashMap::new(),
            stats: GatherStats::default(),
        }
    }

    /// Begins a pass whose piece uses are `plan` (`forward_only` for evaluation).
    pub fn start(&mut self, plan: Vec<(Piece, usize, Pass)>, forward_only: bool) {
        self.plan = plan;
        self.next = 0;
        self.forward_only = forward_only;
        self.stats = GatherStats::default();
    }

    /// The costs of the pass so far.
    pub fn stats(&self) -> GatherStats {
        self.stats
    }

    /// Before `piece`'s use: installs its buckets (waiting for gathers started ahead, starting
    /// the others), then gathers the next use's ahead.
    pub fn before(
        &mut self,
        model: &Llama,
        dp: &DataParallel,
        (piece, micro, pass): (Piece, usize, Pass),
    ) -> Result<()> {
        if self.plan.get(self.next) == Some(&(piece, micro, pass)) {
            self.next += 1;
        }
        let buckets = self.needs_of(piece)?.to_vec();
        for &b in &buckets {
            if !self.installed.contains_key(&b) {
                let ticket = match self.ahead.remove(&b) {
                    Some(t) => t,
                    None => self.submit(dp, b)?,
                };
                let waited = Instant::now();
                let (full, secs) = ticket.wait()?;
                self.stats.wait_s += waited.elapsed().as_secs_f64();
                self.stats.gather_s += secs;
                self.install(model, b, &full)?;
            }
        }
        if let Some(&(next, _, _)) = self.plan.get(self.next) {
            for b in self.needs_of(next)?.to_vec() {
                if !self.installed.contains_key(&b) && !self.ahead.contains_key(&b) {
                    let t = self.submit(dp, b)?;
                    self.ahead.insert(b, t);
                }
            }
        }
        self.track();
        Ok(())
    }

    /// After `piece`'s use: keeps what a later backward needs (a forward without recompute) and
    /// releases the rest unless the next use reads it.
    pub fn after(
        &mut self,
        model: &Llama,
        (piece, _micro, pass): (Piece, usize, Pass),
    ) -> Result<()> {
        let keep = !self.forward_only && self.recompute.for_piece(piece) == Recompute::None;
        let next: HashSet<usize> = match self.plan.get(self.next) {
            Some(&(p, _, _)) => self.needs_of(p)?.iter().copied().collect(),
            None => HashSet::new(),
        };
        for b in self.needs_of(piece)?.to_vec() {
            let holds = self.installed.entry(b).or_insert(0);
            match (keep, pass) {
                (true, Pass::Forward) => *holds += 1,
                (true, Pass::Backward) => *holds = holds.saturating_sub(1),
                _ => {}
            }
            if *holds == 0 && !next.contains(&b) {
                self.installed.remove(&b);
                for i in self.layout.buckets[b].params.clone() {
                    model.params().get(i).release();
                }
            }
        }
        Ok(())
    }

    /// Releases everything (end of a pass) and waits for gathers still in flight.
    pub fn finish(&mut self, model: &Llama) -> Result<()> {
        for (_, t) in self.ahead.drain() {
            t.wait()?;
        }
        for b in std::mem::take(&mut self.installed).into_keys() {
            for i in self.layout.buckets[b].params.clone() {
                model.params().get(i).release();
            }
        }
        Ok(())
    }

    fn needs_of(&self, piece: Piece) -> Result<&[usize]> {
        match self.needs.get(&piece) {
            Some(b) => Ok(b),
            None => bail!("ZeRO-3: piece {piece:?} is not on this rank"),
        }
    }

    fn submit(&self, dp: &DataParallel, b: usize) -> Result<Ticket<(Tensor, f64)>> {
        Ok(dp.gather(b)?)
    }

    fn install(&mut self, model: &Llama, b: usize, full: &Tensor) -> Result<()> {
        let bucket = &self.layout.buckets[b];
        for i in bucket.params.clone() {
            let r = self.layout.range(i);
            model
                .params()
                .get(i)
                .install(&full.narrow(0, r.start - bucket.start, r.len())?)?;
        }
        self.installed.insert(b, 0);
        Ok(())
    }

    /// Updates the peak of live full-parameter bytes.
    fn track(&mut self) {
        let live: usize = self
            .installed
            .keys()
            .chain(self.ahead.keys())
            .map(|&b| self.layout.buckets[b].len * self.elem)
            .sum();
        self.stats.peak_bytes = self.stats.peak_bytes.max(live);
    }
}

/// The whole flat parameters `[layout.total]` (f32) of a stage-3 rank, all-gathered bucket by
/// bucket (every rank of the shard group takes part).
pub fn gather_all(dp: &DataParallel) -> Result<Tensor> {
    let parts = (0..dp.layout().buckets.len())
        .map(|b| Ok(dp.gather(b)?.wait()?.0.to_dtype(DType::F32)?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// A rank's gradients, optimizer and data parallelism at its ZeRO stage.
pub struct RankState {
    /// Gradients: whole (stages 0, 1) or this rank's shards (2, 3).
    pub grads: GradBuffer,
    /// AdamW over the owned flat ranges.
    pub optimizer: AdamW,
    /// Gradient completion, sync and (stage 3) parameter shards.
    pub dp: DataParallel,
    /// Stage 3: installs the parameters pieces use.
    pub gather: Option<Gatherer>,
}

/// Builds the state of rank `ctx` for `model` (fully initialised: at stage 3 the rank keeps its
/// shards and releases the parameters).
pub fn rank_state(recipe: &Recipe, ctx: &RankCtx, model: &Llama) -> Result<RankState> {
    let par = &recipe.parallel;
    let zero = par.zero;
    let chunks = ctx.chunks(model.config().num_hidden_layers);
    let numels: Vec<usize> = model.params().iter().map(|p| p.numel()).collect();
    let shard_index = ctx.dp_shard.index_of(ctx.rank).unwrap_or(0);
    let expert_index = ctx.expert_dp.index_of(ctx.rank).unwrap_or(0);
    let StateLayout { layout, owned } = StateLayout::new(
        par,
        model.inventory(),
        &numels,
        &chunks,
        shard_index,
        expert_index,
    );
    let device = &ctx.device;
    let grads = if zero >= 2 {
        GradBuffer::sharded(layout.clone(), owned.clone(), device)?
    } else {
        GradBuffer::new(layout.clone(), device)?
    };
    let optimizer = AdamW::new(model.params(), &layout, owned.clone(), &recipe.optimizer)?;
    let tied_pipeline = recipe.model.tie_word_embeddings && ctx.pp.size() > 1;
    let partial = model
        .params()
        .iter()
        .map(|p| Partial {
            over_tp: ctx.sequence_parallel && p.shard == Shard::Replicated,
            over_pipeline_ends: tied_pipeline && p.kind == ParamKind::Embedding,
        })
        .collect();
    let groups = DpGroups {
        dp: ctx.dp.clone(),
        shard: ctx.dp_shard.clone(),
        expert: ctx.expert_dp.clone(),
        replicate: ctx.dp_replicate.clone(),
        tp: ctx.tp.clone(),
        pipeline_ends: ctx.embedding_group(),
    };
    let flat = if zero == 3 {
        Some(flatten_params(model.params(), &layout)?)
    } else {
        None
    };
    let dtype = model.params().get(0).dtype;
    let dp = DataParallel::new(
        ctx.comm.clone(),
        layout.clone(),
        groups,
        zero,
        partial,
        grads.flat().clone(),
        owned,
        flat.as_ref().map(|f| (f, dtype)),
    )?;
    let gather = if zero == 3 {
        for p in model.params().iter() {
            p.release();
        }
        Some(Gatherer::new(
            model,
            layout,
            &chunks,
            recipe.train.recompute,
        ))
    } else {
        None
    };
    Ok(RankState {
        grads,
        optimizer,
        dp,
        gather,
    })
}

/// Makes the optimizer's owned master weights the parameters (after a step or a checkpoint
/// load): written whole (stage 0), gathered from the shard group (1, 2), or kept as this rank's
/// shards (3).
pub fn publish(
    optimizer: &AdamW,
    dp: &mut DataParallel,
    model: &Llama,
    ctx: &RankCtx,
) -> Result<()> {
    let master = optimizer.master()?;
    match dp.zero() {
        0 => write_params(model.params(), dp.layout(), &master)?,
        1 | 2 => {
            let (comm, expert) = (ctx.comm.as_ref(), &ctx.expert_dp);
            let full = gather_shards(dp.layout(), &master, comm, &ctx.dp_shard, expert)?;
            write_params(model.params(), dp.layout(), &full)?;
        }
        _ => dp.set_param_shards(&master)?,
    }
    Ok(())
}

/// This rank's whole parameters `[layout.total]` in f32 (at stage 3 all-gathered: every rank of
/// the shard group takes part).
pub fn whole_params(dp: &DataParallel, model: &Llama) -> Result<Tensor> {
    if dp.zero() == 3 {
        gather_all(dp)
    } else {
        Ok(flatten_params(model.params(), dp.layout())?)
    }
}
