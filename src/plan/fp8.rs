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
    /// the backward's GEMMs), and the linears' GEMMs [`FP8_GEMM_SPEEDUP`] times faster. A MoE
    /// block's experts stay in the model dtype: only its attention's four linears.
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
        for (out, inp) in linears {
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
        Cost {
            fwd: self.memory(bytes * fwd) - faster * products.fwd,
            bwd: self.memory(bytes * bwd) - faster * (products.dx + products.dw),
            tp: 0.0,
            wgt: -faster * products.dw,
        }
    }
}
