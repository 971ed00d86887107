//! Predicted step time: per piece and micro-batch, GEMMs on the roofline (a fraction of peak, or
//! HBM speed when their shape makes them memory-bound),
//! the fused attention at its own fraction, memory-bound ops at HBM speed and the tensor-parallel
//! collectives (blocking, on the critical path); stages combined by the pipeline schedule's
//! closed form; data-parallel and ZeRO collectives overlapped with the backward passes as the
//! trainer overlaps them; then the optimizer. Formulas and sources: `docs/PLANNER.md`. Each
//! parallelism's communication terms come from its folder of `crates/parallel/src/`
//! (`register.rs`); this file combines them with the compute.

use model::{LlamaConfig, Piece, Recompute, Recomputed};
use parallel::cp::register::Context;
use parallel::dp::register::{Data, SyncSizes};
use parallel::ep::register::Expert;
use parallel::pipeline::register::Pipeline;
use parallel::pipeline::ScheduleKind;
use parallel::tp::register::Tensor;
use serde::Serialize;

use super::hardware::Hardware;
use crate::recipe::{OptimizerName, Recipe};
use crate::train::rank::chunk_pieces;

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
    /// AdamW update and gradient norm (with Muon, its iterations and exchange too).
    pub optimizer_s: f64,
    /// The step.
    pub step_s: f64,
}

/// Seconds of the forward and backward of one piece for one micro-batch on one GPU.
#[derive(Debug, Clone, Copy, Default)]
struct Cost {
    fwd: f64,
    bwd: f64,
    /// Of which tensor-parallel communication (forward + backward).
    tp: f64,
    /// Of the backward, the weight-gradient GEMMs a zero-bubble schedule runs as its W actions
    /// (a block's projections).
    wgt: f64,
}

struct Model<'a> {
    hw: &'a Hardware,
    c: &'a LlamaConfig,
    /// Tokens of a micro-batch on this rank (its context-parallel share), and on this rank
    /// between TP regions.
    n: f64,
    ns: f64,
    b: f64,
    s: f64,
    /// The share of the causal attention pairs computed (below 1 with a document mask).
    attn_share: f64,
    t: f64,
    p: f64,
    /// Bandwidth of the tensor-parallel group, bytes/s.
    tp_bw: f64,
    /// Context-parallel ranks.
    cp: f64,
    /// Bandwidth between context-parallel neighbours, bytes/s.
    cp_bw: f64,
    /// Expert-parallel ranks, and their all-to-all bandwidth, bytes/s.
    ep: f64,
    ep_bw: f64,
}

/// Fraction of HBM bandwidth memory-bound kernels reach.
const HBM_EFFICIENCY: f64 = 0.8;
/// Share of an overlapped collective's time that still lengthens the step: its kernels take
/// SMs and HBM bandwidth from the compute they run beside.
const OVERLAP_COST: f64 = 0.3;

/// The part of a collective of `total` seconds that lengthens a step when `window` seconds of
/// compute can hide it.
fn exposed(total: f64, window: f64) -> f64 {
    let hidden = total.min(window.max(0.0));
    total - hidden + OVERLAP_COST * hidden
}

impl Model<'_> {
    /// A GEMM `[m, k] × [k, n]` on the roofline: at the GEMM fraction of peak, or at HBM speed
    /// when it moves more bytes than that compute takes.
    fn gemm(&self, m: f64, n: f64, k: f64) -> f64 {
        let compute = 2.0 * m * n * k / (self.hw.peak_tflops * 1e12 * self.hw.gemm_efficiency);
        compute.max(self.memory(self.p * (m * k + k * n + m * n)))
    }

    fn memory(&self, bytes: f64) -> f64 {
        bytes / (self.hw.hbm_gbps * 1e9 * HBM_EFFICIENCY)
    }

    /// A collective of the tensor-parallel group moving `factor × bytes` per GPU.
    fn tp_collective(&self, factor: f64, bytes: f64) -> f64 {
        Tensor::collective_s(self.t, factor, bytes, self.tp_bw)
    }

    /// A decoder block; `moe`: with a mixture-of-experts feed-forward part (the router, and
    /// each token's `k` experts as GEMMs over `n · k` rows: the grouped rows of an expert run as
    /// one GEMM, so the sum over experts is one GEMM's worth of rows).
    /// `recomputed`: what `recompute: selective` rebuilds in the backward.
    fn block(&self, recompute: Recompute, recomputed: Recomputed, moe: bool) -> Cost {
        let c = self.c;
        let (n, t, p) = (self.n, self.t, self.p);
        let h = c.hidden_size as f64;
        let q = c.q_dim() as f64;
        let kv = (c.num_key_value_heads * c.head_dim()) as f64;
        // The experts are not split over tensor-parallel ranks: each routes the tokens it holds
        // (`ns`: its share with sequence parallelism, all of them without). With expert
        // parallelism a rank computes as many rows on average, its experts' rows from the
        // whole group, after an all-to-all that sends (ep − 1) / ep of them away and back.
        let mut a2a = 0.0;
        let (mlp_gemms, mlp_bytes) = match c.moe().filter(|_| moe) {
            Some(m) => {
                let n = self.ns;
                let (e, rows, fe) = (
                    m.num_experts as f64,
                    n * m.top_k as f64,
                    m.expert_size as f64,
                );
                a2a = Expert::exchange_s(self.ep, rows * h * p, self.ep_bw);
                let gemms =
                    self.gemm(n, e, h) + self.gemm(rows, 2.0 * fe, h) + self.gemm(rows, h, fe);
                (gemms, rows * (3.0 * fe + 5.0 * h))
            }
            None => {
                let f = c.intermediate_size as f64;
                let gemms = self.gemm(n, 2.0 * f / t, h) + self.gemm(n, h, f / t);
                (gemms, 3.0 * n * f / t)
            }
        };
        let gemms = self.gemm(n, (q + 2.0 * kv) / t, h) + self.gemm(n, h, q / t) + mlp_gemms;
        // Causal QKᵀ and PV: 2 · 2 · b · s² · q / 2 per rank's heads (the share of it a
        // document mask keeps), split evenly over the context-parallel ranks by the
        // load-balanced chunks.
        let attn_flops = 2.0 * self.b * self.s * self.s * q / t / self.cp * self.attn_share;
        let attn = attn_flops / (self.hw.peak_tflops * 1e12 * self.hw.attention_efficiency);
        let kv_bytes = 2.0 * n * kv / t * p;
        let (ring_fwd, ring_bwd) = Context::ring_s(self.cp, kv_bytes, p, self.cp_bw, attn);
        let tp_copies = if t > 1.0 { 8.0 * n * h } else { 0.0 };
        let mem_bytes = p * (10.0 * self.ns * h + 2.0 * n * (q + kv) / t + mlp_bytes + tp_copies);
        let mem = self.memory(mem_bytes);
        let tp = Tensor::block_s(t, n * h * p, self.tp_bw);
        let fwd = gemms + attn + mem + tp + ring_fwd + a2a;
        let mut bwd = 2.0 * gemms + 2.5 * attn + 2.0 * mem + tp + ring_bwd + a2a;
        let mut tp_all = 2.0 * tp;
        if recompute == Recompute::Full {
            bwd += fwd;
            tp_all += tp;
        }
        // Selective: the norms (memory-bound, and with sequence parallelism the all-gathers
        // before the projections again), the SwiGLU (reads gate and up, writes its output), or
        // one more attention forward.
        let r = recomputed;
        if r.layernorm {
            bwd += self.memory(p * 4.0 * n * h);
            if self.ns < n {
                bwd += tp;
                tp_all += tp;
            }
        }
        if r.mlp_act && !moe {
            bwd += self.memory(p * 3.0 * n * c.intermediate_size as f64 / t);
        }
        if let (true, true, Some(m)) = (r.moe_act, moe, c.moe()) {
            bwd += self.memory(p * 3.0 * self.ns * (m.top_k * m.expert_size) as f64);
        }
        if r.core_attn {
            bwd += attn + ring_fwd;
        }
        Cost {
            fwd,
            bwd,
            tp: tp_all,
            wgt: gemms,
        }
    }

    fn head(&self) -> Cost {
        let c = self.c;
        let (n, t, p) = (self.n, self.t, self.p);
        let (h, v) = (c.hidden_size as f64, c.vocab_size as f64);
        let gemm = self.gemm(n, v / t, h);
        let logits = n * v / t;
        let fwd_mem = self.memory(logits * (p + 3.0 * 4.0) + 2.0 * self.ns * h * p);
        let bwd_mem = self.memory(logits * (3.0 * 4.0 + p) + 2.0 * self.ns * h * p);
        let tp = self.tp_collective((self.t - 1.0) / self.t, n * h * p);
        Cost {
            fwd: gemm + fwd_mem + tp,
            bwd: 2.0 * gemm + bwd_mem + tp,
            tp: 2.0 * tp,
            wgt: 0.0, // the head's weight gradient is not deferred
        }
    }

    fn embedding(&self) -> Cost {
        let h = self.c.hidden_size as f64;
        let mem = self.memory(2.0 * self.n * h * self.p);
        let tp = self.tp_collective(2.0 * (self.t - 1.0) / self.t, self.n * h * self.p);
        Cost {
            fwd: mem + tp,
            bwd: 2.0 * mem,
            tp,
            wgt: 0.0,
        }
    }
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

/// Muon's own seconds on a rank of a stage holding decoder blocks `layers` (its elementwise
/// work is counted with AdamW's): the Newton-Schulz iterations of the whole matrices it owns
/// (the stage's matrices spread evenly over the shard group; every rank iterates all of them
/// without sharding), the tensor-parallel all-gathers that assemble them, and with sharding
/// the exchange over the shard group (each bucket all-gathered in, and broadcast back, in f32).
fn muon_s(r: &Recipe, model: &Model, layers: &[usize], st: &StageState, shard_bw: f64) -> f64 {
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
    let flops: f64 = shapes
        .iter()
        .map(|&s| 2.0 * crate::optim::muon::ns_cost(cfg, s))
        .sum();
    let elems: f64 = shapes.iter().map(|s| (s[0] * s[1]) as f64).sum();
    let sharded = par.zero.shards_optimizer() && par.shard_size() > 1;
    let owners = if sharded {
        par.shard_size() as f64
    } else {
        1.0
    };
    let hw = model.hw;
    let compute = flops / owners / (hw.peak_tflops * 1e12 * hw.gemm_efficiency);
    let t = par.tp as f64;
    let gather = model.tp_collective((t - 1.0) / t, 4.0 * elems / owners);
    let exchange = if sharded {
        2.0 * 4.0 * st.params * (owners - 1.0) / owners / shard_bw
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

/// Bandwidth in bytes/s of a group of `size` ranks spaced `stride` apart: the groups of a layout
/// tile the ranks in aligned blocks of `size · stride`, which lie inside nodes of
/// `gpus_per_node` only when a block divides a node; otherwise some group spans two nodes and,
/// its collectives running at its slowest link's pace, all are priced at the network's rate.
fn group_bandwidth(hw: &Hardware, size: usize, stride: usize) -> f64 {
    let block = size * stride;
    let gbps = if size <= 1 || (block <= hw.gpus_per_node && hw.gpus_per_node.is_multiple_of(block))
    {
        hw.intra_node_gbps
    } else {
        hw.inter_node_gbps
    };
    gbps * 1e9
}

/// The cost model of `r`'s layout on `hw`.
fn model_of<'a>(r: &'a Recipe, hw: &'a Hardware) -> Model<'a> {
    let (par, tr, c) = (&r.parallel, &r.train, &r.model);
    let (tp, cp) = (par.tp, par.cp);
    let n = (tr.micro_batch * tr.seq_len / cp) as f64;
    let p = r.train.dtype.dtype().size_in_bytes() as f64;
    Model {
        hw,
        c,
        n,
        ns: if par.sequence_parallel {
            n / tp as f64
        } else {
            n
        },
        b: tr.micro_batch as f64,
        s: tr.seq_len as f64,
        attn_share: attention_share(r),
        t: tp as f64,
        p,
        tp_bw: group_bandwidth(hw, tp, 1),
        cp: cp as f64,
        cp_bw: group_bandwidth(hw, cp, tp),
        // Expert-parallel ranks are adjacent data-parallel ranks, tp · cp apart.
        ep: par.ep as f64,
        ep_bw: group_bandwidth(hw, par.ep, tp * cp),
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
    let tr = &r.train;
    let time = |x: Cost| x.fwd + x.bwd;
    let (dense, moe) = (
        time(model.block(tr.recompute, tr.recomputed(), false)),
        time(model.block(tr.recompute, tr.recomputed(), true)),
    );
    let cost: Vec<f64> = (0..layers)
        .map(|i| if c.is_moe_layer(i) { moe } else { dense })
        .collect();
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
    let (par, tr, c) = (&r.parallel, &r.train, &r.model);
    let (pp, v, tp) = (par.pp, par.virtual_stages, par.tp);
    let chunk_layers = par.chunk_layers(c.num_hidden_layers);
    let place = par.schedule_kind().placement();
    let dp = par.grad_ranks(); // gradients are reduced over dp × cp
    let m = r.grad_accum_steps() as f64;
    let p = r.train.dtype.dtype().size_in_bytes() as f64;
    let model = model_of(r, hw);
    let (dense, moe) = (
        model.block(tr.recompute, tr.recomputed(), false),
        model.block(tr.recompute, tr.recomputed(), true),
    );
    let (head, embedding) = (model.head(), model.embedding());
    // Pipeline neighbours are tp · cp · dp ranks apart.
    let pp_bw = group_bandwidth(hw, 2, tp * dp);
    let p2p = Pipeline::transfer_s(model.ns * c.hidden_size as f64 * p, pp_bw);
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
                    Piece::Block(i) if c.is_moe_layer(i) => moe,
                    Piece::Block(_) => dense,
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
    // zb-h1 as training runs it: each stage deferring what fits in 1F1B's memory.
    let deferred = match kind {
        ScheduleKind::ZeroBubbleH1 => super::memory::zb_h1_deferrals(r).unwrap_or_default(),
        _ => Vec::new(),
    };
    let bubble_s = Pipeline::bubble_s(kind, (pp, v, m as usize), (mean, bwd, wgt), &deferred);
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
    let sync = Data::sync_s(par.zero, sizes);
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
    let mut optimizer_s = model.memory(st.owned * (4.0 + 2.0 * state + p + 4.0));
    if r.optimizer.name == OptimizerName::Muon {
        let shard_bw = group_bandwidth(hw, par.shard_size(), tp);
        optimizer_s += muon_s(r, &model, &stage_layers[slowest], st, shard_bw);
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
