//! The planner's cost of one piece for one micro-batch on one GPU: GEMMs on the roofline (a
//! fraction of peak, or HBM speed when their shape makes them memory-bound), the fused attention
//! at its own fraction, memory-bound ops at HBM speed and the tensor-parallel collectives; and the
//! bandwidth of a group of ranks by where its members sit. `time.rs` combines the pieces into a
//! step.

use model::{LlamaConfig, Recompute, Recomputed};
use parallel::cp::register::Cp;
use parallel::ep::register::Ep;
use parallel::tp::register::Tp;

use super::hardware::Hardware;
use super::time::attention_share;
use crate::recipe::Recipe;

/// Seconds of the forward and backward of one piece for one micro-batch on one GPU.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Cost {
    pub(super) fwd: f64,
    pub(super) bwd: f64,
    /// Of which tensor-parallel communication (forward + backward).
    pub(super) tp: f64,
    /// Of the backward, the weight-gradient GEMMs a zero-bubble schedule runs as its W actions
    /// (a block's projections).
    pub(super) wgt: f64,
}

pub(super) struct Model<'a> {
    pub(super) hw: &'a Hardware,
    pub(super) c: &'a LlamaConfig,
    /// Tokens of a micro-batch on this rank (its context-parallel share), and on this rank
    /// between TP regions.
    pub(super) n: f64,
    pub(super) ns: f64,
    pub(super) b: f64,
    pub(super) s: f64,
    /// The share of the causal attention pairs computed (below 1 with a document mask).
    pub(super) attn_share: f64,
    pub(super) t: f64,
    pub(super) p: f64,
    /// Bandwidth of the tensor-parallel group, bytes/s.
    pub(super) tp_bw: f64,
    /// Context-parallel ranks.
    pub(super) cp: f64,
    /// Bandwidth between context-parallel neighbours, bytes/s.
    pub(super) cp_bw: f64,
    /// Expert-parallel ranks, and their all-to-all bandwidth, bytes/s.
    pub(super) ep: f64,
    pub(super) ep_bw: f64,
}

/// Fraction of HBM bandwidth memory-bound kernels reach.
pub(super) const HBM_EFFICIENCY: f64 = 0.8;
/// Share of an overlapped collective's time that still lengthens the step: its kernels take
/// SMs and HBM bandwidth from the compute they run beside.
pub(super) const OVERLAP_COST: f64 = 0.3;

/// The part of a collective of `total` seconds that lengthens a step when `window` seconds of
/// compute can hide it.
pub(super) fn exposed(total: f64, window: f64) -> f64 {
    let hidden = total.min(window.max(0.0));
    total - hidden + OVERLAP_COST * hidden
}

impl Model<'_> {
    /// A GEMM `[m, k] × [k, n]` on the roofline: at the GEMM fraction of peak, or at HBM speed
    /// when it moves more bytes than that compute takes.
    pub(super) fn gemm(&self, m: f64, n: f64, k: f64) -> f64 {
        let compute = 2.0 * m * n * k / (self.hw.peak_tflops * 1e12 * self.hw.gemm_efficiency);
        compute.max(self.memory(self.p * (m * k + k * n + m * n)))
    }

    pub(super) fn memory(&self, bytes: f64) -> f64 {
        bytes / (self.hw.hbm_gbps * 1e9 * HBM_EFFICIENCY)
    }

    /// A collective of the tensor-parallel group moving `factor × bytes` per GPU.
    pub(super) fn tp_collective(&self, factor: f64, bytes: f64) -> f64 {
        Tp::collective_s(self.t, factor, bytes, self.tp_bw)
    }

    /// A decoder block; `moe`: with a mixture-of-experts feed-forward part (the router, and
    /// each token's `k` experts as GEMMs over `n · k` rows: the grouped rows of an expert run as
    /// one GEMM, so the sum over experts is one GEMM's worth of rows).
    /// `recomputed`: what `recompute: selective` rebuilds in the backward.
    pub(super) fn block(&self, recompute: Recompute, recomputed: Recomputed, moe: bool) -> Cost {
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
                a2a = Ep::exchange_s(self.ep, rows * h * p, self.ep_bw);
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
        let (ring_fwd, ring_bwd) = Cp::ring_s(self.cp, kv_bytes, p, self.cp_bw, attn);
        let tp_copies = if t > 1.0 { 8.0 * n * h } else { 0.0 };
        let mem_bytes = p * (10.0 * self.ns * h + 2.0 * n * (q + kv) / t + mlp_bytes + tp_copies);
        let mem = self.memory(mem_bytes);
        let tp = Tp::block_s(t, n * h * p, self.tp_bw);
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

    pub(super) fn head(&self) -> Cost {
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

    pub(super) fn embedding(&self) -> Cost {
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

/// Bandwidth in bytes/s of a group of `size` ranks spaced `stride` apart: the groups of a layout
/// tile the ranks in aligned blocks of `size · stride`, which lie inside nodes of
/// `gpus_per_node` only when a block divides a node; otherwise some group spans two nodes and,
/// its collectives running at its slowest link's pace, all are priced at the network's rate.
pub(super) fn group_bandwidth(hw: &Hardware, size: usize, stride: usize) -> f64 {
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
pub(super) fn model_of<'a>(r: &'a Recipe, hw: &'a Hardware) -> Model<'a> {
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
