//! The planner's terms of `train.fp8`: what FP8 linears change in a block's cost (the rounding
//! or quantizing passes, and with FP8 GEMMs their speed).

use super::roofline::{Cost, Model, Products};

/// How many times faster an FP8 GEMM (cuBLASLt, tensorwise) runs than the bf16 one at the
/// block's shapes on Hopper: published measurements give 1.5-1.8x at K = 2048-5632; an
/// assumption until `pretrain bench-rates` measures FP8 GEMMs.
pub(super) const FP8_GEMM_SPEEDUP: f64 = 1.6;

impl Model<'_> {
    /// What FP8 linears (`train.fp8`) change in a block. Emulated: the operands rounded (each
    /// read twice, for its amax and its cast, and written once) at memory speed; forward every
    /// input and weight, backward the weight again, the upstream gradient (twice under
    /// `blockwise`: once per GEMM's blocks) and the input along the tokens. With cuBLASLt: the
    /// same operands quantized to one-byte codes (the weight, input and gradient transposed for
    /// the backward's GEMMs), and the linears' GEMMs [`FP8_GEMM_SPEEDUP`] times faster. A
    /// linear whose three products a rates table measured with FP8 on (`fp8_gemms`) is priced
    /// from those instead. A MoE block's experts stay in the model dtype: only its attention's
    /// four linears.
    pub(super) fn fp8_change(&self, moe: bool, f: &model::Fp8Linears) -> Cost {
        let (c, n, t) = (self.c, self.n, self.t);
        let h = c.hidden_size as f64;
        let (q, kv) = (
            c.q_dim() as f64 / t,
            (c.num_key_value_heads * c.head_dim()) as f64 / t,
        );
        let f_ = c.intermediate_size as f64 / t;
        let mut linears = vec![(q, h), (kv, h), (kv, h), (h, q)]; // (out, in) on this rank
        if !moe {
            linears.extend([(f_, h), (f_, h), (h, f_)]);
        }
        let lt = f.gemm == model::Fp8Gemm::CublasLt;
        let grads = if f.scaling == model::Fp8Scaling::Blockwise {
            2.0
        } else {
            1.0
        };
        let (mut fwd, mut bwd) = (0.0, 0.0);
        let mut products = Products::default();
        let mut measured = Cost::default();
        for (out, inp) in linears {
            // Measured (`pretrain bench-rates` with FP8 on): each product as the linears run
            // it, rounding or quantizing included, in place of the model dtype's product.
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
            fwd += n * inp + out * inp;
            bwd += out * inp + if lt { 2.0 } else { grads } * n * out + n * inp;
            products = products + self.projection(n, out, inp);
        }
        // Bytes per element: read twice and written in the model dtype, or read twice and
        // written as a code.
        let bytes = if lt { 2.0 * self.p + 1.0 } else { 3.0 * self.p };
        let faster = if lt {
            1.0 - 1.0 / FP8_GEMM_SPEEDUP
        } else {
            0.0
        };
        measured
            + Cost {
                fwd: self.memory(bytes * fwd) - faster * products.fwd,
                bwd: self.memory(bytes * bwd) - faster * (products.dx + products.dw),
                tp: 0.0,
                wgt: -faster * products.dw,
            }
    }
}

#[cfg(test)]
mod tests {
    use super::super::rates::{GemmRate, Rates};
    use super::super::roofline::model_of;
    use super::super::{GpuPreset, Hardware};

    /// FP8 rates measured at every shape of a block's linears replace the assumed speed-up and
    /// the quantizing passes: as fast as the model dtype's products, FP8 changes nothing; at
    /// α times their rate it saves `1 − 1/α` of their time.
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
            let d = model_of(&r, &hw).fp8_change(false, &linears);
            (d.fwd + d.bwd, d.wgt)
        };
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 + 1e-9 * b.abs();
        assert!(
            close(change(Some(400.0)).0, 0.0),
            "{:?}",
            change(Some(400.0))
        );
        let (two, four) = (change(Some(800.0)), change(Some(1600.0)));
        assert!(
            two.0 < 0.0 && close(four.0 / two.0, 1.5),
            "{two:?} {four:?}"
        );
        assert!(two.1 < 0.0 && close(four.1 / two.1, 1.5));
        // Without a measured FP8 table: the assumed speed-up less the quantizing passes.
        let assumed = change(None);
        assert!(assumed.0 != 0.0 && !close(assumed.0, two.0));
    }
}
