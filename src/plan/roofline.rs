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

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            fwd: self.fwd + o.fwd,
            bwd: self.bwd + o.bwd,
            tp: self.tp + o.tp,
            wgt: self.wgt + o.wgt,
        }
    }
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
    /// Micro-batches a rank runs per step (what is done once a step is shared among them).
    pub(super) micro_batches: f64,
}

/// Seconds of a piece's projections: forward, input-gradient and weight-gradient GEMMs.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Products {
    pub(super) fwd: f64,
    pub(super) dx: f64,
    pub(super) dw: f64,
}

impl std::ops::Add for Products {
    type Output = Products;
    fn add(self, o: Products) -> Products {
        Products {
            fwd: self.fwd + o.fwd,
            dx: self.dx + o.dx,
            dw: self.dw + o.dw,
        }
    }
}

impl std::ops::Mul<Products> for f64 {
    type Output = Products;
    fn mul(self, p: Products) -> Products {
        Products {
            fwd: self * p.fwd,
            dx: self * p.dx,
            dw: self * p.dw,
        }
    }
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
    /// A GEMM `[m, k] × [k, n]`: at the rate measured for its shape ([`Hardware::rates`]), or
    /// on the roofline, at the GEMM fraction of peak or at HBM speed when it moves more bytes
    /// than that compute takes.
    pub(super) fn gemm(&self, m: f64, n: f64, k: f64) -> f64 {
        let flops = 2.0 * m * n * k;
        if let Some(tflops) = self.hw.rates.and_then(|t| t.gemm(m, n, k)) {
            return flops / (tflops * 1e12);
        }
        let compute = flops / (self.hw.peak_tflops * 1e12 * self.hw.gemm_efficiency);
        compute.max(self.memory(self.p * (m * k + k * n + m * n)))
    }

    /// A projection of `rows` rows from `inp` to `out` features: its forward `x · wᵀ`, input
    /// gradient `g · w` and weight gradient `gᵀ · x`, each priced at its own shape.
    pub(super) fn projection(&self, rows: f64, out: f64, inp: f64) -> Products {
        Products {
            fwd: self.gemm(rows, out, inp),
            dx: self.gemm(rows, inp, out),
            dw: self.gemm(out, inp, rows),
        }
    }

    /// Linears that read one input, fused in the model dtype (`llama/project.rs`): one forward
    /// GEMM to all `outs` features and one input-gradient GEMM from them; the weight gradients
    /// one GEMM each.
    pub(super) fn fused(&self, rows: f64, outs: &[f64], inp: f64) -> Products {
        let total: f64 = outs.iter().sum();
        Products {
            fwd: self.gemm(rows, total, inp),
            dx: self.gemm(rows, inp, total),
            dw: outs.iter().map(|&out| self.gemm(out, inp, rows)).sum(),
        }
    }

    /// The passes of the fused q, k and v: their outputs copied out of the fused one (forward)
    /// and their gradients joined (backward), `[n, (q + 2kv)/t]` read and written each. Gate and
    /// up need none: the SwiGLU reads and writes their joined layout.
    pub(super) fn qkv_split(&self) -> Products {
        let c = self.c;
        let qkv = (c.q_dim() + 2 * c.num_key_value_heads * c.head_dim()) as f64 / self.t;
        let pass = self.memory(2.0 * self.p * self.n * qkv);
        Products {
            fwd: pass,
            dx: pass,
            dw: 0.0,
        }
    }

    /// Memory-bound work moving `bytes`: at the measured element-wise bandwidth, or at the
    /// fraction [`HBM_EFFICIENCY`] of the preset's.
    pub(super) fn memory(&self, bytes: f64) -> f64 {
        match self.hw.rates.and_then(|r| r.bandwidth_gbps) {
            Some(gbps) => bytes / (gbps * 1e9),
            None => bytes / (self.hw.hbm_gbps * 1e9 * HBM_EFFICIENCY),
        }
    }

    /// The causal attention's forward and backward seconds for `flops` forward FLOPs (the
    /// backward does 2.5 times as many): at the rates measured at the model's head dim and the
    /// sequence length, or at the preset's fraction of peak.
    fn attention(&self, flops: f64) -> (f64, f64) {
        match (self.hw.rates).and_then(|r| r.attention(self.c.head_dim(), self.s)) {
            Some((fwd, bwd)) => (flops / (fwd * 1e12), 2.5 * flops / (bwd * 1e12)),
            None => {
                let fwd = flops / (self.hw.peak_tflops * 1e12 * self.hw.attention_efficiency);
                (fwd, 2.5 * fwd)
            }
        }
    }

    /// A collective of the tensor-parallel group moving `factor × bytes` per GPU.
    pub(super) fn tp_collective(&self, factor: f64, bytes: f64) -> f64 {
        Tp::collective_s(self.t, factor, bytes, self.tp_bw)
    }

    /// A decoder block, its projections priced one by one as they run (q, k, v, o; gate, up,
    /// down); `moe`: with a mixture-of-experts feed-forward part (the router, and each token's
    /// `k` experts: this rank's experts each run their share of the `n · k` rows as one GEMM
    /// per projection).
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
        let (mlp, mlp_bytes) = match c.moe().filter(|_| moe) {
            Some(m) => {
                let n = self.ns;
                let (e, fe) = (m.num_experts as f64, m.expert_size as f64);
                // Padded to the capacity, every expert runs its capacity's rows.
                let rows = m.expert_rows(n.round() as usize) as f64;
                a2a = Ep::exchange_s(self.ep, rows * h * p, self.ep_bw);
                let local = e / self.ep;
                let per = rows / local; // rows of one local expert, on average
                let expert = 2.0 * self.projection(per, fe, h) + self.projection(per, h, fe);
                (
                    self.projection(n, e, h) + local * expert,
                    rows * (3.0 * fe + 5.0 * h),
                )
            }
            None => {
                let f = c.intermediate_size as f64;
                let mlp = self.fused(n, &[f / t, f / t], h) + self.projection(n, h, f / t);
                (mlp, 3.0 * n * f / t)
            }
        };
        let qkv = self.fused(n, &[q / t, kv / t, kv / t], h) + self.qkv_split();
        let products = qkv + self.projection(n, h, q / t) + mlp;
        let gemms = products.fwd;
        // Causal QKᵀ and PV: 2 · 2 · b · s² · q / 2 per rank's heads (the share of it a
        // document mask keeps), split evenly over the context-parallel ranks by the
        // load-balanced chunks.
        let attn_flops = 2.0 * self.b * self.s * self.s * q / t / self.cp * self.attn_share;
        let (attn, attn_bwd) = self.attention(attn_flops);
        let kv_bytes = 2.0 * n * kv / t * p;
        let (ring_fwd, ring_bwd) = Cp::ring_s(self.cp, kv_bytes, p, self.cp_bw, attn);
        let tp_copies = if t > 1.0 { 8.0 * n * h } else { 0.0 };
        let mem_bytes = p * (10.0 * self.ns * h + 2.0 * n * (q + kv) / t + mlp_bytes + tp_copies);
        let mem = self.memory(mem_bytes);
        let tp = Tp::block_s(t, n * h * p, self.tp_bw);
        let fwd = gemms + attn + mem + tp + ring_fwd + a2a;
        let mut bwd = products.dx + products.dw + attn_bwd + 2.0 * mem + tp + ring_bwd + a2a;
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
            wgt: products.dw,
        }
    }

    /// Each layer's block: [`Model::block`] at the recipe's recompute, plus the FP8 rounding
    /// where `train.fp8` covers the layer.
    pub(super) fn layers(&self, r: &Recipe) -> Vec<Cost> {
        let (tr, c) = (&r.train, self.c);
        let [dense, moe] = [false, true].map(|m| self.block(tr.recompute, tr.recomputed(), m));
        let fp8 = tr.fp8.linears(c.num_hidden_layers);
        let change = fp8
            .as_ref()
            .map(|f| [false, true].map(|m| self.fp8_change(m, f)));
        (0..c.num_hidden_layers)
            .map(|i| {
                let m = c.is_moe_layer(i);
                let block = if m { moe } else { dense };
                match (&fp8, change) {
                    (Some(f), Some(add)) if f.layers.contains(&i) => block + add[m as usize],
                    _ => block,
                }
            })
            .collect()
    }

    pub(super) fn head(&self) -> Cost {
        let c = self.c;
        let (n, t, p) = (self.n, self.t, self.p);
        let (h, v) = (c.hidden_size as f64, c.vocab_size as f64);
        let gemm = self.projection(n, v / t, h);
        let logits = n * v / t;
        let fwd_mem = self.memory(logits * (p + 3.0 * 4.0) + 2.0 * self.ns * h * p);
        let bwd_mem = self.memory(logits * (3.0 * 4.0 + p) + 2.0 * self.ns * h * p);
        let tp = self.tp_collective((self.t - 1.0) / self.t, n * h * p);
        Cost {
            fwd: gemm.fwd + fwd_mem + tp,
            bwd: gemm.dx + gemm.dw + bwd_mem + tp,
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
        micro_batches: r.grad_accum_steps().max(1) as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::rates::{GemmRate, Rates};
    use crate::plan::GpuPreset;

    /// Every product a dense block and the head run at `r`'s layout (forward, input and weight
    /// gradient of q, k, v, o, gate, up, down, the fused q+k+v and gate+up, and the head), at
    /// `tflops`.
    fn table_of(r: &Recipe, tflops: f64) -> Rates {
        let c = &r.model;
        let n = (r.train.micro_batch * r.train.seq_len) as u64;
        let (h, q, kv, f, v) = (
            c.hidden_size as u64,
            c.q_dim() as u64,
            (c.num_key_value_heads * c.head_dim()) as u64,
            c.intermediate_size as u64,
            c.vocab_size as u64,
        );
        let mut gemms = Vec::new();
        let fused = [(q + 2 * kv, h), (2 * f, h)];
        for (out, inp) in [(q, h), (kv, h), (h, q), (f, h), (h, f), (v, h)]
            .into_iter()
            .chain(fused)
        {
            for (m, nn, k) in [(n, out, inp), (n, inp, out), (out, inp, n)] {
                gemms.push(GemmRate {
                    m,
                    n: nn,
                    k,
                    tflops,
                    what: String::new(),
                });
            }
        }
        Rates {
            device: "test".into(),
            dtype: "bf16".into(),
            gemms,
            attention: Vec::new(),
            bandwidth_gbps: None,
            fp8_gemms: Vec::new(),
        }
    }

    /// A table holding every shape a block prices, at the preset's own GEMM rate, prices the
    /// block as the preset does (the 1B's GEMMs are compute-bound); at twice the rate its GEMMs
    /// take half the time, the rest unchanged.
    #[test]
    fn measured_rates_price_each_projection_at_its_shape() {
        let r = crate::recipe::load(std::path::Path::new("recipes/bench-1b.yaml"), &[]).unwrap();
        let preset = GpuPreset::H100.hardware();
        let rate = preset.peak_tflops * preset.gemm_efficiency;
        let cost = |table: Option<Rates>| {
            let hw = Hardware {
                rates: table.map(Rates::leak),
                ..preset
            };
            let m = model_of(&r, &hw);
            let (b, head) = (
                m.block(Recompute::None, Recomputed::default(), false),
                m.head(),
            );
            (b.fwd, b.bwd, b.wgt, head.fwd, head.bwd)
        };
        let base = cost(None);
        let same = cost(Some(table_of(&r, rate)));
        let fast = cost(Some(table_of(&r, 2.0 * rate)));
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(1e-30);
        assert!(close(base.0, same.0) && close(base.1, same.1) && close(base.2, same.2));
        assert!(close(base.3, same.3) && close(base.4, same.4));
        // The weight-gradient GEMMs are all of `wgt`: twice the rate halves them.
        assert!(close(fast.2, base.2 / 2.0), "{fast:?} {base:?}");
        // The forward keeps its attention and memory-bound time.
        let gemms_fwd = base.0 - fast.0;
        assert!(
            gemms_fwd > 0.0 && close(base.2 / 2.0, gemms_fwd),
            "{fast:?} {base:?}"
        );
    }

    /// Attention at the rate measured for its head dim and length, element-wise work at the
    /// measured bandwidth: at the preset's own rates the block costs the same; at twice the
    /// attention rate its forward loses half the attention's time.
    #[test]
    fn measured_attention_and_bandwidth_replace_the_presets_fractions() {
        use crate::plan::rates::AttentionRate;
        let r = crate::recipe::load(std::path::Path::new("recipes/bench-1b.yaml"), &[]).unwrap();
        let preset = GpuPreset::H100.hardware();
        let attention = preset.peak_tflops * preset.attention_efficiency;
        let bandwidth = preset.hbm_gbps * HBM_EFFICIENCY;
        let block = |scale: f64| {
            let mut rates = table_of(&r, preset.peak_tflops * preset.gemm_efficiency);
            rates.attention = vec![AttentionRate {
                head_dim: r.model.head_dim() as u64,
                seq: r.train.seq_len as u64,
                fwd_tflops: scale * attention,
                bwd_tflops: scale * attention,
                what: String::new(),
            }];
            rates.bandwidth_gbps = Some(bandwidth);
            let hw = Hardware {
                rates: Some(rates.leak()),
                ..preset
            };
            model_of(&r, &hw).block(Recompute::None, Recomputed::default(), false)
        };
        let base = model_of(&r, &preset).block(Recompute::None, Recomputed::default(), false);
        let (same, fast) = (block(1.0), block(2.0));
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs();
        assert!(
            close(base.fwd, same.fwd) && close(base.bwd, same.bwd),
            "{base:?} {same:?}"
        );
        let c = &r.model;
        let (b, s) = (r.train.micro_batch as f64, r.train.seq_len as f64);
        let attn = 2.0 * b * s * s * c.q_dim() as f64 / (attention * 1e12);
        assert!(close(base.fwd - fast.fwd, attn / 2.0), "{base:?} {fast:?}");
        assert!(
            close(base.bwd - fast.bwd, 2.5 * attn / 2.0),
            "{base:?} {fast:?}"
        );
    }
}
