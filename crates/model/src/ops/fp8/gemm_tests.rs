//! The FP8 GEMM plans against cuBLASLt's semantics, evaluated on the CPU: column-major
//! matrices, `op(A) = Aᵀ`, scales multiplying the product. Each of a linear's three products,
//! run from codes laid out as its plan says, must give the row-major product of the operands'
//! rounded values: this is what catches a wrong transpose or leading dimension without a GPU.

use super::*;
use crate::ops::fp8_scale;

/// A row-major `[r, c]` matrix of values, its codes in `format` with one tensorwise scale, and
/// the codes' inverse scale.
struct Coded {
    values: Vec<f32>,
    r: usize,
    c: usize,
    codes: Vec<u8>,
    inv: f32,
    format: Fp8Format,
}

fn coded(r: usize, c: usize, seed: u64, format: Fp8Format) -> Coded {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let values: Vec<f32> = (0..r * c)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
        })
        .collect();
    let amax = values.iter().fold(0f32, |a, v| a.max(v.abs()));
    let scale = fp8_scale(amax, format.max());
    let codes = values.iter().map(|v| format.encode(v * scale)).collect();
    Coded {
        values,
        r,
        c,
        codes,
        inv: 1.0 / scale,
        format,
    }
}

impl Coded {
    /// The rounded value at row-major `(i, j)`.
    fn at(&self, i: usize, j: usize) -> f64 {
        self.format.decode(self.codes[i * self.c + j]) as f64 * self.inv as f64
    }

    /// The codes of the transpose, row-major `[c, r]`.
    fn transposed_codes(&self) -> Vec<u8> {
        let mut t = vec![0; self.codes.len()];
        for i in 0..self.r {
            for j in 0..self.c {
                t[j * self.r + i] = self.codes[i * self.c + j];
            }
        }
        t
    }
}

/// cuBLASLt's `D = a_scale · b_scale · Aᵀ · B (+ D)` on column-major storage.
fn lt(g: &LtGemm, a: (&[u8], Fp8Format, f32), b: (&[u8], Fp8Format, f32), d: &mut [f64]) {
    let elem = |m: &LtMatrix, data: &[u8], f: Fp8Format, r: u64, c: u64| {
        assert!(r < m.rows && c < m.cols && m.ld >= m.rows);
        f.decode(data[(r + c * m.ld) as usize]) as f64
    };
    assert_eq!(
        (g.a.rows, g.a.cols, g.b.rows, g.b.cols),
        (g.k, g.m, g.k, g.n)
    );
    assert_eq!((g.d.rows, g.d.cols), (g.m, g.n));
    for i in 0..g.m {
        for j in 0..g.n {
            let mut sum = 0.0;
            for k in 0..g.k {
                // op(A)[i, k] = A[k, i].
                sum += elem(&g.a, a.0, a.1, k, i) * elem(&g.b, b.0, b.1, k, j);
            }
            let at = (i + j * g.d.ld) as usize;
            let prior = if g.out == LtOut::AccumulateF32 {
                d[at]
            } else {
                0.0
            };
            d[at] = prior + sum * a.2 as f64 * b.2 as f64;
        }
    }
}

fn close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-9 * (1.0 + b.abs()),
            "{what}[{i}]: {a} vs {b}"
        );
    }
}

#[test]
fn each_products_plan_multiplies_its_operands() {
    let (rows, out, inp) = (7, 5, 3);
    let x = coded(rows, inp, 1, Fp8Format::E4M3);
    let w = coded(out, inp, 2, Fp8Format::E4M3);
    let g = coded(rows, out, 3, Fp8Format::E5M2);

    // Forward: A = w's codes, B = x's; D row-major [rows, out].
    let plan = LtGemm::forward(rows, out, inp);
    let mut y = vec![0.0; rows * out];
    lt(
        &plan,
        (&w.codes, w.format, w.inv),
        (&x.codes, x.format, x.inv),
        &mut y,
    );
    let want: Vec<f64> = (0..rows * out)
        .map(|e| (0..inp).map(|k| x.at(e / out, k) * w.at(e % out, k)).sum())
        .collect();
    close(&y, &want, "forward");
    assert!(plan.fast_accum && plan.out == LtOut::Bf16);

    // Input gradient: A = wᵀ's codes, B = g's; D row-major [rows, in].
    let plan = LtGemm::input_grad(rows, out, inp);
    let mut dx = vec![0.0; rows * inp];
    let wt = w.transposed_codes();
    lt(
        &plan,
        (&wt, w.format, w.inv),
        (&g.codes, g.format, g.inv),
        &mut dx,
    );
    let want: Vec<f64> = (0..rows * inp)
        .map(|e| (0..out).map(|k| g.at(e / inp, k) * w.at(k, e % inp)).sum())
        .collect();
    close(&dx, &want, "input gradient");
    assert_eq!(
        (plan.a_format, plan.b_format),
        (Fp8Format::E4M3, Fp8Format::E5M2)
    );

    // Weight gradient: A = xᵀ's codes, B = gᵀ's; accumulated into D row-major [out, in].
    let plan = LtGemm::weight_grad(rows, out, inp);
    let prior: Vec<f64> = (0..out * inp).map(|e| e as f64 * 0.25).collect();
    let mut dw = prior.clone();
    let (xt, gt) = (x.transposed_codes(), g.transposed_codes());
    lt(
        &plan,
        (&xt, x.format, x.inv),
        (&gt, g.format, g.inv),
        &mut dw,
    );
    let want: Vec<f64> = (0..out * inp)
        .map(|e| {
            prior[e]
                + (0..rows)
                    .map(|k| g.at(k, e / inp) * x.at(k, e % inp))
                    .sum::<f64>()
        })
        .collect();
    close(&dw, &want, "weight gradient");
    assert!(!plan.fast_accum && plan.out == LtOut::AccumulateF32);
    // The values multiplied are the operands' own, rounded by at most FP8's half step.
    for (v, i) in x.values.iter().zip(0..) {
        assert!((x.at(i / inp, i % inp) - *v as f64).abs() <= 0.07 * v.abs() as f64 + 1e-2);
    }
}

#[test]
fn the_cpu_products_round_tensorwise_as_the_emulated_path() -> Result<()> {
    let dev = candle_core::Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (2, 9, 32), &dev)?;
    let w = Tensor::randn(0f32, 0.1, (24, 32), &dev)?;
    let g = Tensor::randn(0f32, 1e-3, (2, 9, 24), &dev)?;
    let t = |f| tensorwise(f);
    let y = fp8_linear(&x, &w, (2, 9, 24))?;
    let want = crate::ops::linear(
        &fp8_round(&x, t(Fp8Format::E4M3))?,
        &fp8_round(&w, t(Fp8Format::E4M3))?,
    )?;
    let v = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
    assert_eq!(v(&y)?, v(&want)?);
    let dx = fp8_linear_dx(&w, &g, x.shape())?;
    let want = crate::ops::linear_dx(
        &fp8_round(&w, t(Fp8Format::E4M3))?,
        &fp8_round(&g, t(Fp8Format::E5M2))?,
        x.shape(),
    )?;
    assert_eq!(v(&dx)?, v(&want)?);
    assert!(fp8_linear(&x, &w, (2, 9, 25)).is_err());
    Ok(())
}
