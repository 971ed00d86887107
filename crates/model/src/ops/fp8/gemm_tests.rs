//! The FP8 GEMM plans against cuBLASLt's semantics, evaluated on the CPU: column-major
//! matrices, `op(A) = Aᵀ`, scales multiplying the product (one per operand, or per block as
//! block scaling reads them from the packed layout). Each of a linear's three products, run
//! from codes laid out as its plan says, must give the row-major product of the operands'
//! rounded values: this is what catches a wrong transpose, leading dimension or scale order
//! without a GPU.

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

/// A row-major `[r, c]` matrix's codes by blocks and their inverse scales packed as a part of
/// [`Packing`] says, the way `cuda/fp8.rs` writes them: `codes` (transposed when the part is),
/// `scales` in the part's line order, and each element's rounded value as laid out.
struct Packed {
    codes: Vec<u8>,
    scales: Vec<f32>,
    value: Vec<f64>,
}

fn pack(m: &Coded, blocks: Fp8Blocks, transposed: bool) -> Packed {
    let (r, c) = (m.r, m.c);
    let part = *Packing::new((r, c), None, Some(blocks))
        .transposed
        .filter(|_| transposed)
        .or(Packing::new((r, c), Some(blocks), None).plain)
        .as_ref()
        .unwrap();
    let (br, bc) = blocks.dims(r, c);
    let (nbr, nbc) = (r.div_ceil(br), c.div_ceil(bc));
    let block = |i: usize, j: usize| i / br * nbc + j / bc;
    let mut amax = vec![0f32; nbr * nbc];
    for i in 0..r {
        for j in 0..c {
            let a = &mut amax[block(i, j)];
            *a = a.max(m.values[i * c + j].abs());
        }
    }
    let scale: Vec<f32> = amax.iter().map(|&a| fp8_scale(a, m.format.max())).collect();
    let (mut codes, mut value) = (vec![0u8; r * c], vec![0f64; r * c]);
    for i in 0..r {
        for j in 0..c {
            let s = scale[block(i, j)];
            let code = m.format.encode(m.values[i * c + j] * s);
            codes[if transposed { j * r + i } else { i * c + j }] = code;
            value[i * c + j] = m.format.decode(code) as f64 / s as f64;
        }
    }
    // The kernel's order: position line · ld + k holds block (k, line) of the grid's columns
    // when column-major, else block (line, k); padding stays zero.
    let (inner, lines) = if part.colmajor() {
        (nbr, nbc)
    } else {
        (nbc, nbr)
    };
    assert_eq!(
        (part.lines, part.ld % 4, part.ld >= inner),
        (lines, 0, true)
    );
    let mut scales = vec![0f32; part.ld * part.lines];
    for line in 0..lines {
        for k in 0..inner {
            let b = if part.colmajor() {
                k * nbc + line
            } else {
                line * nbc + k
            };
            scales[line * part.ld + k] = 1.0 / scale[b];
        }
    }
    Packed {
        codes,
        scales,
        value,
    }
}

/// cuBLASLt's block-scaled `D (+)= Aᵀ · B` with each operand `mn × K` K-major (its codes
/// row-major `[mn, K]`) and scaled as its mode says: `VEC128_32F` reads scale
/// `(k / 128) · ld + i`, `BLK128x128_32F` scale `(i / 128) · ld + k / 128`, `ld` the part's line.
fn lt_blocks(
    g: &LtGemm,
    a: (&Packed, Fp8Format, usize),
    b: (&Packed, Fp8Format, usize),
    d: &mut [f64],
) {
    let elem = |(p, f, ld): (&Packed, Fp8Format, usize), scale: LtScale, i: u64, k: u64| {
        let s = match scale {
            LtScale::Vec128 => p.scales[(k / 128) as usize * ld + i as usize],
            LtScale::Blk128 => p.scales[(i / 128) as usize * ld + (k / 128) as usize],
            LtScale::Scalar => p.scales[0],
        };
        f.decode(p.codes[(i * g.k + k) as usize]) as f64 * s as f64
    };
    for i in 0..g.m {
        for j in 0..g.n {
            let sum: f64 = (0..g.k)
                .map(|k| elem(a, g.a_scale, i, k) * elem(b, g.b_scale, j, k))
                .sum();
            let at = (i + j * g.d.ld) as usize;
            let prior = if g.out == LtOut::AccumulateF32 {
                d[at]
            } else {
                0.0
            };
            d[at] = prior + sum;
        }
    }
}

/// Each product of a blockwise linear, run from codes and scales packed as `Packing` lays them
/// out and read as cuBLASLt's block scaling reads them, gives the row-major product of the
/// operands' rounded values: what catches a scale order, line stride or part mix-up without a
/// GPU. The grids are not multiples of 4 wide, so the padded lines are exercised.
#[test]
fn block_scaled_plans_read_the_scales_as_packed() {
    use Fp8Blocks::{Cols, Rows, Tiles};
    let (rows, out, inp) = (256, 384, 640);
    let x = coded(rows, inp, 4, Fp8Format::E4M3);
    let w = coded(out, inp, 5, Fp8Format::E4M3);
    let g = coded(rows, out, 6, Fp8Format::E5M2);
    let part = |m: &Coded, blocks, transposed| {
        let p = Packing::new((m.r, m.c), Some(blocks), Some(blocks));
        let part = if transposed { p.transposed } else { p.plain }.unwrap();
        (part.scale().unwrap(), part.ld)
    };
    let value = |p: &Packed, c: usize, i: usize, j: usize| p.value[i * c + j];

    // Forward: A = w's tiles as laid out, B = x's 1 × 128 runs.
    let (wp, xp) = (pack(&w, Tiles, false), pack(&x, Rows, false));
    let ((sa, lda), (sb, ldb)) = (part(&w, Tiles, false), part(&x, Rows, false));
    let plan = LtGemm::forward(rows, out, inp).scaled(sa, sb);
    let mut y = vec![0.0; rows * out];
    lt_blocks(&plan, (&wp, w.format, lda), (&xp, x.format, ldb), &mut y);
    let want: Vec<f64> = (0..rows * out)
        .map(|e| {
            (0..inp)
                .map(|k| value(&xp, inp, e / out, k) * value(&wp, inp, e % out, k))
                .sum()
        })
        .collect();
    close(&y, &want, "forward");
    assert!(!plan.fast_accum, "block scaling without fast accumulation");

    // Input gradient: A = w's tiles transposed, B = g's 1 × 128 runs.
    let (wt, gp) = (pack(&w, Tiles, true), pack(&g, Rows, false));
    let ((sa, lda), (sb, ldb)) = (part(&w, Tiles, true), part(&g, Rows, false));
    let plan = LtGemm::input_grad(rows, out, inp).scaled(sa, sb);
    let mut dx = vec![0.0; rows * inp];
    lt_blocks(&plan, (&wt, w.format, lda), (&gp, g.format, ldb), &mut dx);
    let want: Vec<f64> = (0..rows * inp)
        .map(|e| {
            (0..out)
                .map(|k| value(&gp, out, e / inp, k) * value(&wt, inp, k, e % inp))
                .sum()
        })
        .collect();
    close(&dx, &want, "input gradient");

    // Weight gradient: A = x's 128 × 1 runs transposed, B = g's; accumulated.
    let (xt, gt) = (pack(&x, Cols, true), pack(&g, Cols, true));
    let ((sa, lda), (sb, ldb)) = (part(&x, Cols, true), part(&g, Cols, true));
    let plan = LtGemm::weight_grad(rows, out, inp).scaled(sa, sb);
    let prior: Vec<f64> = (0..out * inp).map(|e| e as f64 * 0.25).collect();
    let mut dw = prior.clone();
    lt_blocks(&plan, (&xt, x.format, lda), (&gt, g.format, ldb), &mut dw);
    let want: Vec<f64> = (0..out * inp)
        .map(|e| {
            prior[e]
                + (0..rows)
                    .map(|k| value(&gt, out, k, e / inp) * value(&xt, inp, k, e % inp))
                    .sum::<f64>()
        })
        .collect();
    close(&dw, &want, "weight gradient");
    assert_eq!(
        (plan.a_scale, plan.b_scale),
        (LtScale::Vec128, LtScale::Vec128)
    );
}
