//! The planner's terms of `train.fp8`: what FP8 linears change in a block's cost (the rounding
//! or quantizing passes, and with FP8 GEMMs their speed).

use super::roofline::{Cost, Model, Products};

/// How many times faster an FP8 GEMM (cuBLASLt, tensorwise) runs than the bf16 one at the
/// block's shapes on Hopper: published measurements give 1.5-1.8x at K = 2048-5632; an
/// assumption until `pretrain bench-rates` measures FP8 GEMMs.
pub(super) const FP8_GEMM_SPEEDUP: f64 = 1.6;

impl Model<'_> {
    /// What FP8 linears (`train.fp8`) change in a block, per micro-batch: they run one by one
    /// where the model dtype fuses those reading one input (q, k, v; gate, up). Emulated: the
    /// operands rounded (each read twice, for its amax and its cast, and written once) at memory
    /// speed: forward each input once for the linears that read it (q, k, v; gate, up) and each
    /// weight once a step (kept for the step's micro-batches, both GEMMs' forms from one pass);
    /// backward each upstream gradient (twice under `blockwise`: once per GEMM's blocks) and
    /// each input along the tokens, once for the linears that read it. With cuBLASLt: the same
    /// quantized to one-byte codes (under tensorwise an upstream gradient's two layouts, for
    /// the input and the weight gradient, from one pass), and the linears' GEMMs run
    /// [`FP8_GEMM_SPEEDUP`] times faster (blockwise scaling too: an assumption both ways). A linear whose three products a rates table measured
    /// with FP8 on (`fp8_gemms`) is priced from those instead. A MoE block's experts stay in
    /// the model dtype: only its attention's four linears.
    pub(super) fn fp8_change(&self, moe: bool, f: &model::Fp8Linears) -> Cost {
        let (c, n, t) = (self.c, self.n, self.t);
        let h = c.hidden_size as f64;
        let (q, kv) = (
            c.q_dim() as f64 / t,
            (c.num_key_value_heads * c.head_dim()) as f64 / t,
        );
        let f_ = c.intermediate_size as f64 / t;
        // Linears by the input they read: (their widths out, in) on this rank.
        let mut groups: Vec<(Vec<f64>, f64)> = vec![(vec![q, kv, kv], h), (vec![h], q)];
        if !moe {
            groups.extend([(vec![f_, f_], h), (vec![h], f_)]);
        }
        let lt = f.gemm == model::Fp8Gemm::CublasLt;
        let grads = if f.scaling == model::Fp8Scaling::Blockwise {
            2.0
        } else {
            1.0
        };
        // Bytes of a pass over an element: read twice and written in the model dtype, or read
        // twice and written as a code (`both`: as laid out and transposed).
        let (one, both) = if lt {
            (2.0 * self.p + 1.0, 2.0 * self.p + 2.0)
        } else {
            (3.0 * self.p, 3.0 * self.p)
        };
        // Bytes rounded or quantized per micro-batch, and once a step (the weights).
        let (mut fwd, mut bwd, mut weights) = (0.0, 0.0, 0.0);
        let mut products = Products::default();
        let mut measured = Cost::default();
        for (outs, inp) in groups {
            if outs.len() > 1 {
                // FP8 linears (each weight with its own scales) run one by one, not fused.
                let apart = outs.iter().fold(Products::default(), |s, &out| {
                    s + self.projection(n, out, inp)
                });
                let mut fused = self.fused(n, &outs, inp);
                if outs.len() == 3 {
                    fused = fused + self.qkv_split();
                }
                measured.fwd += apart.fwd - fused.fwd;
                measured.bwd += apart.dx - fused.dx + apart.dw - fused.dw;
            }
            let mut input_read = false;
            for out in outs {
                // Measured (`pretrain bench-rates` with FP8 on): each product as the linears
                // run it, rounding or quantizing included, in place of the model dtype's.
                let rate = |m: f64, n_: f64, k: f64| {
                    let fp8 = self.hw.rates.and_then(|r| r.fp8_gemm(m, n_, k))?;
                    Some(2.0 * m * n_ * k / (fp8 * 1e12) - self.gemm(m, n_, k))
                };
                let three = [rate(n, out, inp), rate(n, inp, out), rate(out, inp, n)];
                if let [Some(f), Some(dx), Some(dw)] = three {
                    measured.fwd += f;
                    measured.bwd += dx + dw;
                    measured.wgt += dw;
                    continue;
                }
                weights += both * out * inp;
                // With FP8 GEMMs and one tensor scale, one pass writes both GEMMs' codes of the
                // upstream gradient (blockwise: two, by their own blocks).
                bwd += if lt && grads == 1.0 {
                    both
                } else {
                    grads * one
                } * n
                    * out;
                if !input_read {
                    fwd += one * n * inp;
                    bwd += one * n * inp; // the weight gradients' input factor
                    input_read = true;
                }
                products = products + self.projection(n, out, inp);
            }
        }
        let faster = if lt {
            1.0 - 1.0 / FP8_GEMM_SPEEDUP
        } else {
            0.0
        };
        let weights = self.memory(weights) / self.micro_batches;
        measured
            + Cost {
                fwd: self.memory(fwd) + weights - faster * products.fwd,
                bwd: self.memory(bwd) - faster * (products.dx + products.dw),
                tp: 0.0,
                wgt: -faster * products.dw,
            }
    }
}

/// The FP8 linears' weight operands a rank of the stage holding `layers` keeps: all of them for
/// the step, or with ZeRO-3 only while their piece is gathered (the current piece's and the
/// next's).
pub(super) fn kept_on_stage(r: &crate::recipe::Recipe, layers: &[usize]) -> u64 {
    if r.parallel.zero.shards_parameters() {
        let most = layers.iter().map(|&i| kept_weight_bytes(r, &[i]));
        2 * most.max().unwrap_or(0)
    } else {
        kept_weight_bytes(r, layers)
    }
}

/// Bytes a rank keeps of the FP8 linears' weight operands for the step on the layers
/// `layers` (`Parameter::fp8_operand`): a weight's rounded values in the model dtype
/// (emulated), or its codes as laid out and transposed (cuBLASLt); the experts stay in the
/// model dtype.
pub(super) fn kept_weight_bytes(r: &crate::recipe::Recipe, layers: &[usize]) -> u64 {
    let c = &r.model;
    let Some(f) = r.train.fp8.linears(c.num_hidden_layers) else {
        return 0;
    };
    let per_elem = match f.gemm {
        model::Fp8Gemm::CublasLt => 2,
        model::Fp8Gemm::Emulated => r.train.dtype.dtype().size_in_bytes() as u64,
    };
    let (h, q, f_) = (
        c.hidden_size as u64,
        c.q_dim() as u64,
        c.intermediate_size as u64,
    );
    let kv = (c.num_key_value_heads * c.head_dim()) as u64;
    let attention = h * (2 * q + 2 * kv);
    let per_layer = |i: usize| {
        let mlp = if c.is_moe_layer(i) { 0 } else { 3 * h * f_ };
        (attention + mlp) / r.parallel.tp as u64
    };
    layers
        .iter()
        .filter(|&&i| f.layers.contains(&i))
        .map(|&i| per_layer(i) * per_elem)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::super::rates::{GemmRate, Rates};
    use super::super::roofline::model_of;
    use super::super::{GpuPreset, Hardware};
    use super::kept_weight_bytes;

    /// FP8 rates measured at every shape of a block's linears replace the assumed speed-up and
    /// the quantizing passes: as fast as the model dtype's products, FP8 changes only the fused
    /// q, k and v's splitting and joining passes (it runs them one by one); at α times their
    /// rate it saves `1 − 1/α` of their time.
    #[test]
    fn measured_fp8_rates_price_the_linears() {
        let set = "train.fp8.scaling=tensorwise,train.fp8.gemm=cublaslt".to_string();
        let r = crate::recipe::load(std::path::Path::new("recipes/bench-1b.yaml"), &[set]).unwrap();
        let c = &r.model;
        let n = (r.train.micro_batch * r.train.seq_len) as u64;
        let (h, q, f) = (
            c.hidden_size as u64,
            c.q_dim() as u64,
            c.intermediate_size as u64,
        );
        let kv = (c.num_key_value_heads * c.head_dim()) as u64;
        let table = |tflops: f64| -> Vec<GemmRate> {
            let mut all = Vec::new();
            for (out, inp) in [(q, h), (kv, h), (h, q), (f, h), (h, f)] {
                for (m, nn, k) in [(n, out, inp), (n, inp, out), (out, inp, n)] {
                    all.push(GemmRate {
                        m,
                        n: nn,
                        k,
                        tflops,
                        what: String::new(),
                    });
                }
            }
            all
        };
        let linears = r.train.fp8.linears(c.num_hidden_layers).unwrap();
        let change = |fp8: Option<f64>| {
            let rates = Rates {
                device: "test".into(),
                dtype: "bf16".into(),
                gemms: table(400.0),
                attention: Vec::new(),
                bandwidth_gbps: None,
                fp8_gemms: fp8.map(table).unwrap_or_default(),
            };
            let hw = Hardware {
                rates: Some(rates.leak()),
                ..GpuPreset::H100.hardware()
            };
            let m = model_of(&r, &hw);
            let d = m.fp8_change(false, &linears);
            // What the fused q, k and v spend splitting and joining their outputs (the model
            // dtype's forward and input gradient), which FP8 linears, one by one, do not.
            let split = m.qkv_split();
            (d.fwd + d.bwd, d.wgt, split.fwd + split.dx)
        };
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 + 1e-9 * b.abs();
        let same = change(Some(400.0));
        assert!(same.2 > 0.0 && close(same.0, -same.2), "{same:?}");
        assert!(close(same.1, 0.0), "{same:?}");
        let (two, four) = (change(Some(800.0)), change(Some(1600.0)));
        let (saved2, saved4) = (two.0 - same.0, four.0 - same.0);
        assert!(
            saved2 < 0.0 && close(saved4 / saved2, 1.5),
            "{two:?} {four:?}"
        );
        assert!(two.1 < 0.0 && close(four.1 / two.1, 1.5));
        // Without a measured FP8 table: the assumed speed-up less the quantizing passes.
        let assumed = change(None);
        assert!(assumed.0 != 0.0 && !close(assumed.0, two.0));
    }

    /// A weight is quantized once a step, so its pass is shared by the step's micro-batches;
    /// the operands kept for the step are each FP8 layer's linears, two codes per element with
    /// FP8 GEMMs and a rounded value in the model dtype emulated.
    #[test]
    fn weights_are_quantized_once_a_step_and_kept() {
        let load = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            crate::recipe::load(std::path::Path::new("recipes/bench-1b.yaml"), &sets).unwrap()
        };
        let lt = ["train.fp8.scaling=tensorwise", "train.fp8.gemm=cublaslt"];
        let hw = GpuPreset::H100.hardware();
        let fwd = |r: &crate::recipe::Recipe| {
            let f = r.train.fp8.linears(r.model.num_hidden_layers).unwrap();
            model_of(r, &hw).fp8_change(false, &f).fwd
        };
        let (one, four) = (
            load(&[lt[0], lt[1], "train.global_batch=2"]),
            load(&[lt[0], lt[1], "train.global_batch=8"]),
        );
        assert_eq!((one.grad_accum_steps(), four.grad_accum_steps()), (1, 4));
        assert!(fwd(&four) < fwd(&one), "{} {}", fwd(&four), fwd(&one));
        let c = &one.model;
        let (h, q, f) = (
            c.hidden_size as u64,
            c.q_dim() as u64,
            c.intermediate_size as u64,
        );
        let kv = (c.num_key_value_heads * c.head_dim()) as u64;
        let linears = h * (2 * q + 2 * kv) + 3 * h * f;
        let layers: Vec<usize> = (0..c.num_hidden_layers).collect();
        let fp8_layers = one
            .train
            .fp8
            .linears(c.num_hidden_layers)
            .unwrap()
            .layers
            .len() as u64;
        assert_eq!(kept_weight_bytes(&one, &layers), fp8_layers * linears * 2);
        let emulated = load(&["train.fp8.scaling=blockwise"]);
        assert_eq!(
            kept_weight_bytes(&emulated, &layers),
            fp8_layers * linears * 2
        ); // bf16
        assert_eq!(kept_weight_bytes(&load(&[]), &layers), 0);
    }
}
