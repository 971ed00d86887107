//! Predicted bytes per rank: the persistent state from the same flat layout the trainer builds
//! (exact), and the activations from what each piece's tape keeps for its backward pass, walked
//! through the stage's own pipeline schedule (the executor's accounting, `train/pipeline.rs`,
//! measures the same quantity).
//!
//! Per micro-batch of `n = b·s` tokens on a rank of tensor-parallel size `t` (`n_s = n / t` with
//! sequence parallelism, else `n`), `p` bytes per element (the tapes: `model::llama::BlockTape`,
//! `HeadTape`, `EmbeddingTape`, `model::moe::MoeTape`):
//!
//! The byte formulas sit next to the tapes (`BlockTape::bytes`, `MoeTape::bytes`,
//! `HeadTape::bytes`, `EmbeddingTape::bytes`):
//!
//! | piece | keeps |
//! |---|---|
//! | dense block | its input and the residual after attention `2 · n_s · h`; both norms as the projections read them `2 · n · h`; rotated q, k and v `n · (q + 2 kv) / t`; the attention output `n · q / t` (f32 on the CPU for 16-bit models, except from the ring) and its f32 log-sum-exp; gate, up and SwiGLU `3 · n · f / t` |
//! | MoE block | the attention half above; the routed rows' norm `[n_s, h]`, the router's f32 probabilities, log-sum-exps, routing weights and expert shares; the experts' outputs in slot order and their input rows `2 · n_s k · h`; each expert's gate, up and SwiGLU `3 · n_s k · f_e` |
//! | head | its input `[n_s, h]`, the norm's rows `[n, h]`, labels and mask; on one rank the logits `n · V` and the f32 losses, under TP the vocab-parallel loss's f32 exponentials `n · V / t` and four `[n]` vectors |
//! | embedding | the ids it looked up (u32), and under TP the ownership mask `[n]` |
//!
//! Under `recompute: full` a block keeps only its input, and its backward rebuilds the tape above
//! while it runs. Under `recompute: selective` a block's tape leaves out `train.recompute_modules`
//! (`layernorm`: both norms' `[n, h]`; `mlp_act`: the SwiGLU `n · f / t`; `moe_act`: the experts'
//! SwiGLU; `core_attn`: the attention output and its log-sum-exp), which its backward rebuilds
//! and holds as a temporary.

use std::sync::OnceLock;

use model::placement::{chunk_pieces, state_layout};
use model::{Inventory, Piece, Recompute};
use parallel::dp::{StateBytes, ZeroStage};
use parallel::pipeline::{
    build, build_zb_h1, zb_h1, zbv, Action, ChunkPlacement, Schedule, ScheduleError, ScheduleKind,
};
use serde::Serialize;

use super::acts::{Acts, PieceActs};
use super::memo::{memo, Memo};
use super::PlanError;
use crate::recipe::{Offload, OptimizerName, Recipe};

/// Predicted bytes of the most loaded rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct MemoryBytes {
    /// Parameters in the training dtype (whole, or ZeRO-3 shards).
    pub parameters: u64,
    /// fp32 gradients (whole, or ZeRO-2/3 shards).
    pub gradients: u64,
    /// fp32 master weights and AdamW moments (fp32 or bf16) of the owned ranges.
    pub optimizer: u64,
    /// Peak activations kept for backward passes (all in-flight micro-batches of the stage,
    /// logits and loss included) plus a recomputing backward's rebuilt tape.
    pub activations: u64,
    /// ZeRO-3: full parameters gathered at once.
    pub gathered_parameters: u64,
    /// ZeRO-2/3: full-size fp32 gradients staged for their reduce-scatter: a piece's being
    /// accumulated and [`parallel::dp::STAGED_IN_FLIGHT`] pieces' handed to the communication
    /// thread (its bound with one pipeline stage; with several the queue is unbounded and this is
    /// what a network that keeps up with the backward holds).
    pub staged_gradients: u64,
    /// Temporaries of the largest backward (gradients of the logits or of a block's widest
    /// tensors, on cuDNN with its attention backward's workspace) and one communication bucket
    /// (a reduction's result on the CPU backends; NCCL reduces the buckets in place, so on a GPU
    /// this slightly over-counts).
    pub temporaries: u64,
    /// All of the above: the device's bytes.
    pub total: u64,
    /// In host memory, with `optimizer.offload: cpu`: the master weights and moments, and the
    /// parts of gradients and parameters on their way (not in `total`).
    pub host: u64,
}

/// The memory of one pipeline stage (its ranks are alike).
#[derive(Debug, Clone, Serialize)]
pub struct StageMemory {
    /// Pipeline stage.
    pub stage: usize,
    /// Its bytes.
    pub bytes: MemoryBytes,
    /// Micro-batches whose activations it holds at its peak.
    pub in_flight: usize,
    /// Elements of its flat gradient layout (padding included).
    #[serde(skip)]
    pub flat_elems: u64,
    /// Elements whose optimizer state a rank owns.
    #[serde(skip)]
    pub owned_elems: u64,
    /// Elements of its parameters.
    #[serde(skip)]
    pub param_elems: u64,
}

/// Predicted memory of every pipeline stage of `r`'s layout (the first shard index of each
/// stage: shards are equal in size).
pub fn stages(r: &Recipe) -> Result<Vec<StageMemory>, PlanError> {
    let (par, train, c) = (&r.parallel, &r.train, &r.model);
    let (pp, v, t) = (par.pp, par.virtual_stages, par.tp);
    let chunk_layers = par.chunk_layers(c.num_hidden_layers);
    let model = Acts::new(r);
    let p = model.shapes.p;
    let schedule = walked_schedule(r)?;
    let acts = |piece: Piece| model.of(piece);
    let model_key = format!("{c:?} tp {t}");
    let mut out = Vec::with_capacity(pp);
    for stage in 0..pp {
        let chunks: Vec<Vec<Piece>> = (0..v)
            .map(|k| chunk_pieces(schedule.global_chunk(stage, k), &chunk_layers))
            .collect();
        let layers: Vec<usize> = chunks
            .iter()
            .flatten()
            .filter_map(|p| match p {
                Piece::Block(i) => Some(*i),
                _ => None,
            })
            .collect();
        // Expert-parallel rank 0's share of the experts (every share has the same size).
        let experts = c.moe().map_or(0, |m| m.num_experts / par.ep.max(1));
        let holds = |p: Piece| chunks.iter().flatten().any(|&q| q == p);
        let (embedding, head) = (holds(Piece::Embedding), holds(Piece::Head));
        let held =
            super::memo::stage_parameters(&model_key, c, (&layers, embedding, head, experts), t)?;
        let (inventory, numels) = (&held.0, &held.1);
        let state = state_layout(par, inventory, numels, &chunks, (0, 0));
        let moments = r.optimizer.state_dtype.dtype();
        let StateBytes {
            param_bytes,
            grad_bytes,
            mut optimizer_bytes,
        } = state.bytes(par, numels, r.train.dtype.dtype(), moments);
        if r.optimizer.name == OptimizerName::Muon {
            // Muon keeps a master weight and an f32 momentum (8 bytes) per hidden matrix element
            // instead of AdamW's master and two moments. Shards are equal in size but not in
            // their share of hidden matrices: the most loaded rank is the one with the fewest.
            let hidden = fewest_hidden(par, inventory, numels, &chunks);
            let adamw = 4 + 2 * moments.size_in_bytes();
            optimizer_bytes = optimizer_bytes - adamw * hidden + 8 * hidden;
        }
        let piece_acts: Vec<Vec<PieceActs>> = chunks
            .iter()
            .map(|pieces| pieces.iter().map(|&pc| acts(pc)).collect())
            .collect();
        let (activations, in_flight) = peak_activations(
            &schedule.actions[stage],
            &chunks,
            &piece_acts,
            train.recompute,
        );
        let piece_bytes = |pc: Piece| -> u64 {
            inventory
                .piece_params(pc)
                .iter()
                .map(|&i| numels[i] as u64)
                .sum()
        };
        let all_pieces: Vec<Piece> = chunks.iter().flatten().copied().collect();
        let largest = all_pieces
            .iter()
            .map(|&pc| piece_bytes(pc))
            .max()
            .unwrap_or(0);
        // ZeRO-3: the current piece's parameters and the next's, gathered ahead.
        let gathered_parameters = if par.zero.shards_parameters() {
            p * 2 * largest
        } else {
            0
        };
        let staged_gradients = if par.zero.shards_gradients() {
            4 * largest * (1 + parallel::dp::STAGED_IN_FLIGHT as u64)
        } else {
            0
        };
        let temp = piece_acts
            .iter()
            .flatten()
            .map(|a| a.temp)
            .max()
            .unwrap_or(0);
        let bucket = if par.zero.shards_gradients() {
            0
        } else {
            (4 * par.bucket_size as u64).min(4 * numels.iter().sum::<usize>() as u64)
        };
        // ZeRO 1-2 gather each bucket in place in the packed parameters; with offloaded masters
        // they publish one bucket at a time through a copy, in the parameters' dtype: the
        // gathered bucket and this rank's cast shard of it (after the step's other temporaries
        // are gone, hence the larger of the two).
        let sharded = matches!(par.zero, ZeroStage::Optimizer | ZeroStage::Gradients);
        let publish = if sharded && r.optimizer.offload == Offload::Cpu {
            let shards = par.shard_size().max(1) as u64;
            let largest = state.layout.buckets.iter().map(|b| b.len as u64).max();
            p * largest.unwrap_or(0) * (shards + 1) / shards
        } else {
            0
        };
        // Offloaded: the state on the host, with up to three parts (one a bucket) of f32
        // gradients (one being updated, one queued, one being copied) and a part's cast
        // parameters; on the device a part's gradients on their way to the host and its
        // parameters back.
        let (optimizer_bytes, host, offload_temp) = if r.optimizer.offload == Offload::Cpu {
            let shards = if par.zero.shards_optimizer() {
                par.shard_size().max(1) as u64
            } else {
                1
            };
            let buckets = &state.layout.buckets;
            let part = buckets.iter().map(|b| b.len as u64).max().unwrap_or(0) / shards;
            let in_flight = buckets.len().min(3) as u64;
            let host = optimizer_bytes as u64 + (in_flight * 4 + p) * part;
            (0, host, (4 + p) * part)
        } else {
            (optimizer_bytes, 0, 0)
        };
        let mut bytes = MemoryBytes {
            parameters: param_bytes as u64 + super::fp8::kept_on_stage(r, &layers),
            gradients: grad_bytes as u64,
            optimizer: optimizer_bytes as u64,
            activations,
            gathered_parameters,
            staged_gradients,
            temporaries: temp + bucket.max(publish).max(offload_temp),
            total: 0,
            host,
        };
        bytes.total = bytes.parameters
            + bytes.gradients
            + bytes.optimizer
            + bytes.activations
            + bytes.gathered_parameters
            + bytes.staged_gradients
            + bytes.temporaries;
        out.push(StageMemory {
            stage,
            bytes,
            in_flight,
            flat_elems: state.layout.total as u64,
            owned_elems: state.owned_elems() as u64,
            param_elems: numels.iter().sum::<usize>() as u64,
        });
    }
    Ok(out)
}

/// The fewest hidden matrix elements (Muon's) a rank of one stage owns: the fewest of any
/// shard index in the dense buckets plus the fewest of any expert shard index in the routed
/// experts' buckets.
fn fewest_hidden(
    par: &parallel::ParallelConfig,
    inventory: &Inventory,
    numels: &[usize],
    chunks: &[Vec<Piece>],
) -> usize {
    let hidden = inventory.hidden_matrices();
    let split = par.ep > 1;
    let expert = inventory.expert_flags();
    let of = |want_expert: bool| -> Vec<bool> {
        (0..hidden.len())
            .map(|i| hidden[i] && (split && expert[i]) == want_expert)
            .collect()
    };
    let (dense, routed) = (of(false), of(true));
    let (shards, expert_shards) = if par.zero.shards_optimizer() {
        (par.shard_size(), par.expert_grad_ranks())
    } else {
        (1, 1)
    };
    let fewest = |n: usize, flags: &[bool], at: &dyn Fn(usize) -> (usize, usize)| {
        (0..n)
            .map(|i| state_layout(par, inventory, numels, chunks, at(i)).owned_of(flags))
            .min()
            .unwrap_or(0)
    };
    fewest(shards, &dense, &|i| (i, 0)) + fewest(expert_shards, &routed, &|j| (0, j))
}

/// The schedule whose actions the memory walk follows (up to `2·pp` micro-batches: schedules
/// repeat their steady state, and the peak is reached within them; a multiple of pp, as
/// interleaving needs).
fn walked_schedule(r: &Recipe) -> Result<Schedule, PlanError> {
    let (pp, m) = (r.parallel.pp, r.grad_accum_steps());
    schedule(r, if m >= 2 * pp { 2 * pp } else { m })
}

/// The schedule `r`'s steps run with `m` micro-batches, as training builds it: the zero-bubble
/// ones within 1F1B's memory — zb-h1's stages defer as many weight actions as
/// [`zb_h1_deferrals`] allows, zbv's hold as many as [`zbv_caps`] allows (in its order for unit
/// costs; training re-orders it for measured ones).
pub fn schedule(r: &Recipe, m: usize) -> Result<Schedule, PlanError> {
    static BUILT: Memo<Schedule> = OnceLock::new();
    let par = &r.parallel;
    let (kind, pp, v) = (par.schedule_kind(), par.pp, par.virtual_stages);
    // What the schedule is built from: its kind and sizes, and the zero-bubble fits.
    let fitted = match kind {
        ScheduleKind::ZeroBubbleH1 => zb_h1_deferrals(r)?,
        ScheduleKind::ZeroBubbleV => zbv_caps(r)?,
        _ => Vec::new(),
    };
    let key = format!("{kind:?} pp {pp} v {v} m {m} {fitted:?}");
    memo(&BUILT, Some(key), || {
        let schedule = match kind {
            ScheduleKind::ZeroBubbleH1 => build_zb_h1(pp, m, &fitted),
            ScheduleKind::ZeroBubbleV => super::memo::unit_zbv(pp, m, &fitted),
            kind => build(kind, pp, v, m),
        };
        schedule.map_err(PlanError::Schedule)
    })
}

/// How many weight actions each stage of a zb-h1 pipeline defers: the paper's `s` on stage `s`
/// (for the least idle time) unless the factors held for them would take the stage's
/// activations past 1F1B's peak (the most any stage holds under 1F1B) — then as many as fit.
/// A stage holding more than the others (the head's logits on the last) defers fewer.
pub fn zb_h1_deferrals(r: &Recipe) -> Result<Vec<usize>, PlanError> {
    static FITTED: Memo<Vec<usize>> = OnceLock::new();
    let m_sim = r.grad_accum_steps().min(2 * r.parallel.pp);
    memo(&FITTED, fit_key("zb-h1", r, m_sim), || {
        fit_zb_h1_deferrals(r)
    })
}

fn fit_zb_h1_deferrals(r: &Recipe) -> Result<Vec<usize>, PlanError> {
    let (par, c) = (&r.parallel, &r.model);
    let pp = par.pp;
    let m_sim = r.grad_accum_steps().min(2 * pp);
    let model = Acts::new(r);
    let layers = par.chunk_layers(c.num_hidden_layers);
    let budget = one_f_one_b_peak(r, &model, &layers, m_sim)?;
    let walk = |s: usize, actions: &[Action]| {
        let chunks = vec![chunk_pieces(s, &layers)];
        walk_stage(r, &model, &chunks, actions)
    };
    Ok((0..pp)
        .map(|s| {
            (0..=zb_h1::deferred_weights(s, m_sim))
                .rev()
                .find(|&d| walk(s, &zb_h1::stage_actions(pp, s, m_sim, d)) <= budget)
                .unwrap_or(0)
        })
        .collect())
}

/// How many chunk activations each stage of a zbv pipeline may hold: `2·pp` (1F1B's first
/// stage holds `pp` micro-batches of both halves of its layers) unless that takes the stage past
/// 1F1B's peak for stages of the same layers — the first stage, which holds the head's logits
/// too, usually holds fewer; with an uneven `parallel.pipeline_layout` (e.g. empty first and
/// last chunks) another stage may. Lowered one at a time until every stage fits (at least 2
/// each). The caps are fitted on `min(m, 3·pp)` micro-batches of the step's `m`.
pub fn zbv_caps(r: &Recipe) -> Result<Vec<usize>, PlanError> {
    static FITTED: Memo<Vec<usize>> = OnceLock::new();
    let m_sim = r.grad_accum_steps().min(3 * r.parallel.pp);
    memo(&FITTED, fit_key("zbv", r, m_sim), || fit_zbv_caps(r))
}

fn fit_zbv_caps(r: &Recipe) -> Result<Vec<usize>, PlanError> {
    let (par, c) = (&r.parallel, &r.model);
    let pp = par.pp;
    let m = r.grad_accum_steps();
    let m_sim = m.min(3 * pp);
    let model = Acts::new(r);
    let layers = par.chunk_layers(c.num_hidden_layers);
    let vee = ChunkPlacement::Vee;
    let (down, up) = (
        |s: usize| vee.global(pp, s, 0),
        |s: usize| vee.global(pp, s, 1),
    );
    let per_stage: Vec<usize> = (0..pp).map(|s| layers[down(s)] + layers[up(s)]).collect();
    let budget = one_f_one_b_peak(r, &model, &per_stage, m_sim)?;
    let mut fit = zbv::Fit::unit(pp);
    loop {
        let schedule = super::memo::unit_zbv(pp, m_sim, &fit.caps).map_err(|e| match e {
            // Name what the user set, not the shortened walk's size.
            ScheduleError::Stalled { .. } => PlanError::ZbvStalled {
                pp,
                m,
                layers: layers.clone(),
                caps: fit.caps.clone(),
                m_sim,
            },
            e => PlanError::Budget(e),
        })?;
        let mut lowered = false;
        for s in 0..pp {
            let chunks = vec![chunk_pieces(down(s), &layers), chunk_pieces(up(s), &layers)];
            if fit.caps[s] > 2 && walk_stage(r, &model, &chunks, &schedule.actions[s]) > budget {
                fit.caps[s] -= 1;
                lowered = true;
            }
        }
        if !lowered {
            return Ok(fit.caps);
        }
    }
}

/// The key of a zero-bubble fit (`kind`) of `r` on `m_sim` micro-batches: the recipe with what
/// activations and the fitted walk do not depend on made equal (the ZeRO stage, the moments'
/// dtype, the data-parallel size and the global batch but for the walk's micro-batches). The
/// layout search plans each layout for every stage, both moment dtypes and every data-parallel
/// size, and fitting the zero-bubble schedules was most of a plan's time. `None` when the recipe
/// cannot be written (it is then fitted each time).
fn fit_key(kind: &str, r: &Recipe, m_sim: usize) -> Option<String> {
    let mut key = r.clone();
    key.parallel.zero = ZeroStage::default();
    key.optimizer.state_dtype = Default::default();
    key.parallel.dp = 1;
    key.train.global_batch = m_sim * key.train.micro_batch;
    serde_json::to_string(&key)
        .ok()
        .map(|k| format!("{kind} {k}"))
}

/// The most activation bytes any stage holds under 1F1B with `layers[s]` layers on stage `s`.
fn one_f_one_b_peak(
    r: &Recipe,
    model: &Acts,
    layers: &[usize],
    m: usize,
) -> Result<u64, PlanError> {
    let plain = build(ScheduleKind::OneFOneB, layers.len(), 1, m).map_err(PlanError::Budget)?;
    Ok((0..layers.len())
        .map(|s| walk_stage(r, model, &[chunk_pieces(s, layers)], &plain.actions[s]))
        .max()
        .unwrap_or(0))
}

/// The peak activation bytes of a stage holding `chunks` running `actions`.
fn walk_stage(r: &Recipe, model: &Acts, chunks: &[Vec<Piece>], actions: &[Action]) -> u64 {
    let acts: Vec<Vec<PieceActs>> = chunks
        .iter()
        .map(|c| c.iter().map(|&p| model.of(p)).collect())
        .collect();
    peak_activations(actions, chunks, &acts, r.train.recompute).0
}

/// Walks one stage's actions: a forward adds what each piece keeps, a backward first rebuilds a
/// recomputed piece's tape on top of everything live, then frees each piece — but for the
/// factors a split backward keeps of each block until the weight action. Returns the peak bytes
/// and the (chunk, micro-batch) pairs in flight at the peak.
fn peak_activations(
    actions: &[Action],
    chunks: &[Vec<Piece>],
    acts: &[Vec<PieceActs>],
    recompute: Recompute,
) -> (u64, usize) {
    let kept = |c: usize, i: usize| -> u64 {
        let a = acts[c][i];
        match recompute.for_piece(chunks[c][i]) {
            // Under `selective` the tape's bytes already leave the recomputed modules out.
            Recompute::None | Recompute::Selective => a.tape + a.input,
            Recompute::Full => a.input,
        }
    };
    let (mut live, mut peak, mut in_flight, mut at_peak) = (0u64, 0u64, 0usize, 0usize);
    let split = actions.iter().any(|a| matches!(a, Action::Weight { .. }));
    for a in actions {
        match *a {
            Action::Forward { chunk, .. } => {
                let bytes: u64 = (0..chunks[chunk].len()).map(|i| kept(chunk, i)).sum();
                live += bytes;
                in_flight += 1;
                if live > peak {
                    (peak, at_peak) = (live, in_flight);
                }
            }
            Action::Backward { chunk, .. } => {
                for i in (0..chunks[chunk].len()).rev() {
                    if recompute.for_piece(chunks[chunk][i]) == Recompute::Full {
                        // The rebuilt tape (its input is already counted).
                        let rebuilt = acts[chunk][i].tape;
                        if live + rebuilt > peak {
                            (peak, at_peak) = (live + rebuilt, in_flight);
                        }
                    }
                    live -= kept(chunk, i);
                    if split {
                        live += acts[chunk][i].factors;
                        if live > peak {
                            (peak, at_peak) = (live, in_flight);
                        }
                    }
                }
                if !split {
                    in_flight -= 1;
                }
            }
            Action::Weight { chunk, .. } => {
                live -= acts[chunk].iter().map(|a| a.factors).sum::<u64>();
                in_flight -= 1;
            }
            _ => {}
        }
    }
    (peak, at_peak)
}
