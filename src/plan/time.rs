//! Predicted step time: the pieces' costs per micro-batch (`roofline.rs`) combined into stages
//! by the pipeline schedule's closed form, data-parallel and ZeRO collectives overlapped with the
//! backward passes as the trainer overlaps them, then the optimizer. Formulas and sources:
//! `docs/PLANNER.md`. Each parallelism's communication terms come from its folder of
//! `crates/parallel/src/` (`register.rs`); this file combines them with the compute.

use model::placement::chunk_pieces;
use model::Piece;
use parallel::dp::register::{Dp, SyncSizes};
use parallel::pipeline::register::Pp;
use parallel::pipeline::ScheduleKind;
use serde::Serialize;

use super::hardware::Hardware;
use super::memo::{memo, Memo};
use super::roofline::{exposed, group_bandwidth, model_of, Cost, Model};
use crate::recipe::{Offload, OptimizerName, Recipe};

/// Predicted seconds of one optimizer step, by part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepTime {
    /// Compute of the most loaded stage's micro-batches (GEMMs, attention, memory-bound ops,
    /// recomputation).
    pub compute_s: f64,
    /// Tensor-parallel collectives on the critical path.
    pub tp_comm_s: f64,
    /// Pipeline sends and receives of the most loaded stage.
    pub pp_comm_s: f64,
    /// Pipeline bubble (idle time of the schedule's warm-up and cool-down).
    pub bubble_s: f64,
    /// Data-parallel / ZeRO collectives of a step, in all.
    pub dp_comm_s: f64,
    /// Their part not hidden behind the backward passes.
    pub dp_exposed_s: f64,
    /// AdamW update and gradient norm (with Muon, its iterations and exchange too; offloaded,
    /// the copies to and from the host and the update there, pipelined).
    pub optimizer_s: f64,
    /// The step.
    pub step_s: f64,
}

/// Per-stage parameter elements (local, padded) and owned elements, from the memory model.
pub struct StageState {
    /// Elements of the stage's flat gradient buffer.
    pub total: f64,
    /// Elements whose optimizer state a rank owns.
    pub owned: f64,
    /// Elements of the stage's parameters.
    pub params: f64,
}

/// Seconds of an offloaded AdamW update not hidden by anything (the norm before it is on the
/// device): each part's gradients copied to the host (4 bytes an owned element), updated there
/// (the copy's gradient written and read, the `state` bytes read and written, the cast
/// parameter written: the node's host bandwidth shared by its ranks), its parameters (`p`
/// bytes) copied back. The three are pipelined over the parts (one per bucket): the slowest's
/// time plus one part of each other.
fn offload_s(r: &Recipe, hw: &Hardware, st: &StageState, (p, state): (f64, f64)) -> f64 {
    let host = &hw.host;
    let ranks = hw.gpus_per_node.min(r.parallel.world_size()).max(1) as f64;
    let link = host.pcie_gbps * 1e9;
    let stages = [
        4.0 * st.owned / link,
        st.owned * (8.0 + 2.0 * state + p) / (host.memory_gbps * 1e9 / ranks),
        p * st.owned / link,
    ];
    let parts = (st.total / r.parallel.bucket_size.max(1) as f64)
        .ceil()
        .max(1.0);
    let slowest = stages.iter().copied().fold(0.0, f64::max);
    slowest + (stages.iter().sum::<f64>() - slowest) / parts
}

/// The ranks Muon's matrices are spread over (each orthogonalised by one of them): the shard
/// group with ZeRO sharding, the gradient group without (its state is replicated there).
fn muon_owners(par: &parallel::ParallelConfig) -> usize {
    if par.zero.shards_optimizer() {
        par.shard_size()
    } else {
        par.grad_ranks()
    }
}

/// Muon's own seconds on a rank of a stage holding decoder blocks `layers` (its elementwise
/// work is counted with AdamW's): the Newton-Schulz iterations of the whole matrices it owns
/// (the stage's matrices spread evenly over [`muon_owners`], then over the tensor-parallel
/// peers), the tensor-parallel all-gathers that assemble them and broadcasts that return the
/// results, and the exchange over the owners' group at `spread_bw` (in f32: with sharding each
/// bucket all-gathered in and broadcast back, without only broadcast back).
fn muon_s(r: &Recipe, model: &Model, layers: &[usize], st: &StageState, spread_bw: f64) -> f64 {
    let (c, par) = (&r.model, &r.parallel);
    let (h, q) = (c.hidden_size, c.q_dim());
    let kv = c.num_key_value_heads * c.head_dim();
    let mut shapes: Vec<[usize; 2]> = Vec::new();
    for &i in layers {
        shapes.extend([[q, h], [kv, h], [kv, h], [h, q]]);
        match c.moe().filter(|_| c.is_moe_layer(i)) {
            Some(m) => {
                let (e, f) = (m.num_experts / par.ep.max(1), m.expert_size);
                shapes.extend((0..e).flat_map(|_| [[f, h], [f, h], [h, f]]));
            }
            None => {
                let f = c.intermediate_size;
                shapes.extend([[f, h], [f, h], [h, f]]);
            }
        }
    }
    let cfg = &r.optimizer.muon;
    let flops: f64 = shapes.iter().map(|&s| 2.0 * cfg.ns_cost(s)).sum();
    let elems: f64 = shapes.iter().map(|s| (s[0] * s[1]) as f64).sum();
    let owners = muon_owners(par) as f64;
    let passes = if par.zero.shards_optimizer() {
        2.0
    } else {
        1.0
    };
    let hw = model.hw;
    let t = par.tp as f64;
    // Tensor-parallel peers split their owner's iterations and broadcast the results back.
    let compute = flops / owners / t / (hw.peak_tflops * 1e12 * hw.gemm_efficiency);
    let gather = 2.0 * model.tp_collective((t - 1.0) / t, 4.0 * elems / owners);
    let exchange = if owners > 1.0 {
        passes * 4.0 * st.params * (owners - 1.0) / owners / spread_bw
    } else {
        0.0
    };
    compute + gather + exchange
}

/// The share of the causal attention pairs `r`'s steps compute: `data.attention_share` with
/// a document mask (measured by `pretrain plan` from the data when unset there; causal
/// otherwise), 1 without.
pub fn attention_share(r: &Recipe) -> f64 {
    match (r.data.reset_attention_mask, r.data.attention_share) {
        (true, Some(a)) => a,
        _ => 1.0,
    }
}

/// The layers per pipeline chunk (`parallel.pipeline_layout`) that make the slowest chunk of
/// `r`'s layout fastest on `hw`, counting the embedding on the first chunk and the head on the
/// last (forward and backward of one micro-batch; middle chunks hold at least one layer).
/// `None` without pipeline parallelism or with too few layers. The smallest feasible cap on a
/// chunk's time is found by bisection, each cap checked by filling chunks in order.
pub fn balanced_layout(r: &Recipe, hw: &Hardware) -> Option<Vec<usize>> {
    let (par, c) = (&r.parallel, &r.model);
    let (chunks, layers) = (par.pp * par.virtual_stages, c.num_hidden_layers);
    if par.pp < 2 || layers + 2 < chunks {
        return None;
    }
    let model = model_of(r, hw);
    let time = |x: Cost| x.fwd + x.bwd;
    let cost: Vec<f64> = model.layers(r).into_iter().map(time).collect();
    let (head, embedding) = (time(model.head()), time(model.embedding()));
    // Layers per chunk under `cap`, filling each chunk in order as far as it goes; `None` when
    // the cap cannot be met.
    let fill = |cap: f64| -> Option<Vec<usize>> {
        let mut out = vec![0; chunks];
        let mut i = 0;
        for (k, n) in out.iter_mut().enumerate().take(chunks - 1) {
            let mut t = if k == 0 { embedding } else { 0.0 };
            if t > cap {
                return None;
            }
            while i < layers && t + cost[i] <= cap {
                t += cost[i];
                i += 1;
                *n += 1;
            }
            if k > 0 && *n == 0 && i < layers {
                return None; // a middle chunk cannot take even one layer
            }
        }
        let rest: f64 = cost[i..].iter().sum();
        out[chunks - 1] = layers - i;
        (head + rest <= cap).then_some(out)
    };
    let (mut lo, mut hi) = (0.0, embedding + head + cost.iter().sum::<f64>());
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if fill(mid).is_some() {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let mut out = fill(hi)?;
    // Filling in order can leave later middle chunks empty: give each one a layer from the
    // nearest earlier chunk that has one to spare (only lowering that chunk's time).
    for k in (1..chunks - 1).rev() {
        if out[k] == 0 {
            let from = (0..k).rev().find(|&j| out[j] > usize::from(j > 0))?;
            out[from] -= 1;
            out[k] += 1;
            // The layers between keep their order: chunks `from + 1 .. k` shift by one.
        }
    }
    Some(out)
}

/// The predicted time of one step of `r` on `hw`, with each stage's state sizes.
pub fn step_time(r: &Recipe, hw: &Hardware, state: &[StageState]) -> (StepTime, f64) {
    let (par, c) = (&r.parallel, &r.model);
    let (pp, v, tp) = (par.pp, par.virtual_stages, par.tp);
    let chunk_layers = par.chunk_layers(c.num_hidden_layers);
    let place = par.schedule_kind().placement();
    let dp = par.grad_ranks(); // gradients are reduced over dp × cp
    let m = r.grad_accum_steps() as f64;
    let p = r.train.dtype.dtype().size_in_bytes() as f64;
    let model = model_of(r, hw);
    let blocks = model.layers(r);
    let (head, embedding) = (model.head(), model.embedding());
    // Pipeline neighbours are tp · cp · dp ranks apart.
    let pp_bw = group_bandwidth(hw, 2, tp * dp);
    let p2p = Pp::transfer_s(model.ns * c.hidden_size as f64 * p, pp_bw);
    let mut per_stage = Vec::with_capacity(pp);
    let mut stage_layers: Vec<Vec<usize>> = vec![Vec::new(); pp];
    for (stage, layers) in stage_layers.iter_mut().enumerate() {
        let mut cost = Cost::default();
        let mut sends = 0.0;
        for k in 0..v {
            let g = place.global(pp, stage, k);
            for piece in chunk_pieces(g, &chunk_layers) {
                if let Piece::Block(i) = piece {
                    layers.push(i);
                }
                let x = match piece {
                    Piece::Embedding => embedding,
                    Piece::Block(i) => blocks[i],
                    Piece::Head => head,
                };
                cost.fwd += x.fwd;
                cost.bwd += x.bwd;
                cost.tp += x.tp;
                cost.wgt += x.wgt;
            }
            // A chunk receives its input and sends its output (and the gradients back), unless
            // the neighbour is on this stage (a V's turn) or there is none.
            let other = |n: usize| n < pp * v && place.locate(pp, n).0 != stage;
            sends += [g.wrapping_sub(1), g + 1]
                .into_iter()
                .filter(|&n| other(n))
                .count() as f64;
        }
        let pp_s = if pp > 1 { sends * 2.0 * p2p } else { 0.0 };
        per_stage.push((cost, pp_s));
    }
    let stage_time = |(c, s): &(Cost, f64)| c.fwd + c.bwd + s;
    let (slowest, worst) = per_stage
        .iter()
        .enumerate()
        .map(|(i, x)| (i, stage_time(x)))
        .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
    let mean = per_stage.iter().map(stage_time).sum::<f64>() / pp as f64;
    let mean_of =
        |f: &dyn Fn(&Cost) -> f64| per_stage.iter().map(|(c, _)| f(c)).sum::<f64>() / pp as f64;
    let (bwd, wgt) = (mean_of(&|c| c.bwd), mean_of(&|c| c.wgt));
    let kind = par.schedule_kind();
    // The zero-bubble schedules as training runs them: zb-h1's stages deferring, zbv's holding,
    // what fits in 1F1B's memory.
    let limits = match kind {
        ScheduleKind::ZeroBubbleH1 => super::memory::zb_h1_deferrals(r).unwrap_or_default(),
        ScheduleKind::ZeroBubbleV => super::memory::zbv_caps(r).unwrap_or_default(),
        _ => Vec::new(),
    };
    let bubble_s = bubble(kind, (pp, v, m as usize), (mean, bwd, wgt), &limits);
    let pipeline_s = m * worst + bubble_s;

    // Data parallelism on the slowest stage.
    let st = &state[slowest];
    let sizes = SyncSizes {
        grad_ranks: dp,
        shard: par.shard_size(),
        micro_batches: m,
        grad_bytes: 4.0 * st.total,
        param_bytes: p * st.params,
        grad_bw: group_bandwidth(hw, dp, tp),
        shard_bw: group_bandwidth(hw, par.shard_size(), tp),
    };
    let sync = Dp::sync_s(par.zero, sizes);
    // Stages 0 and 1 reduce behind the last backward; 2 and 3 every micro-batch's, so all but
    // the last piece's reduce-scatter can hide behind the schedule's compute.
    let window = if sync.per_micro {
        pipeline_s - per_stage[slowest].0.bwd / m.max(1.0)
    } else {
        per_stage[slowest].0.bwd
    };
    let (dp_comm_s, dp_exposed_s) = (
        sync.overlapped + sync.after,
        exposed(sync.overlapped, window) + sync.after,
    );
    // Per owned element: the gradient read, the state (fp32 master, two moments) read and
    // written, the parameter written and the gradient read again by the norm.
    let moment = r.optimizer.state_dtype.dtype().size_in_bytes() as f64;
    let state = 4.0 + 2.0 * moment;
    let mut optimizer_s = match r.optimizer.offload {
        Offload::None => model.memory(st.owned * (4.0 + 2.0 * state + p + 4.0)),
        Offload::Cpu => model.memory(st.owned * 4.0) + offload_s(r, hw, st, (p, state)),
    };
    if r.optimizer.name == OptimizerName::Muon {
        let spread_bw = group_bandwidth(hw, muon_owners(par), tp);
        optimizer_s += muon_s(r, &model, &stage_layers[slowest], st, spread_bw);
    }
    let (cost, pp_s) = per_stage[slowest];
    let step_s = pipeline_s + dp_exposed_s + optimizer_s;
    let time = StepTime {
        compute_s: m * (cost.fwd + cost.bwd - cost.tp),
        tp_comm_s: m * cost.tp,
        pp_comm_s: m * pp_s,
        bubble_s,
        dp_comm_s,
        dp_exposed_s,
        optimizer_s,
        step_s,
    };
    (time, bubble_s / pipeline_s)
}

/// [`Pp::bubble_s`], remembered: the layout search prices each layout for every ZeRO stage and
/// both moment dtypes, whose stage costs are often the same.
fn bubble(
    kind: ScheduleKind,
    sizes: (usize, usize, usize),
    costs: (f64, f64, f64),
    limits: &[usize],
) -> f64 {
    static SIMULATED: Memo<f64> = std::sync::OnceLock::new();
    let bits = (costs.0.to_bits(), costs.1.to_bits(), costs.2.to_bits());
    let key = format!("{kind:?} {sizes:?} {bits:?} {limits:?}");
    let simulate = || Ok::<_, std::convert::Infallible>(Pp::bubble_s(kind, sizes, costs, limits));
    memo(&SIMULATED, Some(key), simulate).unwrap_or_else(|never| match never {})
}
