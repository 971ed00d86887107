//! Tests of `model::ops::rope`: finite-difference gradients (f64), agreement with a composition
//! of candle primitives (f32, f64), per-sample tables, non-contiguous input and errors.

mod common;
use common::expect_err;

mod ops_util;

use candle_core::{DType, Device, Result, Tensor};
use model::ops::rope;
use ops_util::{assert_close, check_fd_grads, check_vs_reference, run_with_grads, Rng};

fn op(t: &[Tensor]) -> Result<Tensor> {
    rope(&t[0], &t[1], &t[2])
}

/// `[x1 cos - x2 sin, x2 cos + x1 sin]` on the halves of `d`, from candle primitives.
fn reference(t: &[Tensor]) -> Result<Tensor> {
    let (x, cos, sin) = (&t[0], &t[1], &t[2]);
    let (_, s, _, d) = x.dims4()?;
    let half = d / 2;
    let cos = cos.reshape((1, s, 1, half))?;
    let sin = sin.reshape((1, s, 1, half))?;
    let (x1, x2) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
    let y1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let y2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Tensor::cat(&[y1, y2], 3)
}

/// Random `x` `[b, s, h, d]` and the cos/sin tables `[s, d / 2]` of real rotation angles.
fn inputs(rng: &mut Rng, (b, s, h, d): (usize, usize, usize, usize), dtype: DType) -> Vec<Tensor> {
    let angles = rng.tensor((s, d / 2), 3.0, DType::F64);
    vec![
        rng.tensor((b, s, h, d), 1.0, dtype),
        angles.cos().unwrap().to_dtype(dtype).unwrap(),
        angles.sin().unwrap().to_dtype(dtype).unwrap(),
    ]
}

/// Analytic dx vs central finite differences, f64, tolerance 1e-6 (see `FD_TOL`).
#[test]
fn gradients_match_finite_differences() {
    let mut rng = Rng::new(1);
    check_fd_grads(&op, &inputs(&mut rng, (2, 3, 2, 8), DType::F64), &[0], 11);
}

/// Output and dx vs the primitive composition: f64 within 1e-12, f32 within 1e-6.
#[test]
fn matches_primitive_composition() {
    let mut rng = Rng::new(2);
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
        for dims in [(2, 5, 3, 16), (1, 70, 4, 32), (1, 1, 1, 2)] {
            check_vs_reference(
                &op,
                &reference,
                &inputs(&mut rng, dims, dtype),
                &[0],
                tol,
                21,
            );
        }
    }
}

/// `x` as a narrowed view of a fused projection gives the same output and gradient as a copy;
/// f32 cos/sin tables work with bf16 `x`.
#[test]
fn non_contiguous_input_and_mixed_tables() {
    let mut rng = Rng::new(3);
    let t = inputs(&mut rng, (2, 6, 5, 8), DType::F32);
    let r = rng.tensor((2, 6, 3, 8), 1.0, DType::F32);
    let view = |t: &[Tensor]| rope(&t[0].narrow(2, 1, 3)?, &t[1], &t[2]);
    let copy = |t: &[Tensor]| rope(&t[0].narrow(2, 1, 3)?.contiguous()?, &t[1], &t[2]);
    let (o1, g1) = run_with_grads(&view, &t, &[0], &r);
    let (o2, g2) = run_with_grads(&copy, &t, &[0], &r);
    assert_close("output", &o1, &o2, 0.0, 0.0);
    assert_close("dx", &g1[0], &g2[0], 0.0, 0.0);

    let xb = t[0].to_dtype(DType::BF16).unwrap();
    let yb = rope(&xb, &t[1], &t[2]).unwrap();
    assert_eq!(yb.dtype(), DType::BF16);
    assert_close("bf16 output", &yb, &op(&t).unwrap(), 2e-2, 2e-2);
}

/// Tables per sample (`[b, s, d/2]`, positions restarting at each document) rotate each sample
/// as its own `[s, d/2]` table does, forward and backward, bit for bit.
#[test]
fn per_sample_tables_rotate_each_sample_by_its_own_rows() {
    let mut rng = Rng::new(5);
    let (b, s, h, d) = (3, 7, 2, 8);
    let x = rng.tensor((b, s, h, d), 1.0, DType::F64);
    let tables: Vec<Vec<Tensor>> = (0..b)
        .map(|_| inputs(&mut rng, (1, s, h, d), DType::F64)[1..].to_vec())
        .collect();
    let stack = |i: usize| Tensor::stack(&tables.iter().map(|t| &t[i]).collect::<Vec<_>>(), 0);
    let (cos, sin) = (stack(0).unwrap(), stack(1).unwrap());
    let y = rope(&x, &cos, &sin).unwrap();
    let dy = model::ops::rope_bwd(&x, &cos, &sin).unwrap();
    for (bi, t) in tables.iter().enumerate() {
        let xb = x.narrow(0, bi, 1).unwrap();
        let want = rope(&xb, &t[0], &t[1]).unwrap();
        assert_close("forward", &y.narrow(0, bi, 1).unwrap(), &want, 0.0, 0.0);
        let want = model::ops::rope_bwd(&xb, &t[0], &t[1]).unwrap();
        assert_close("backward", &dy.narrow(0, bi, 1).unwrap(), &want, 0.0, 0.0);
    }
}

#[test]
fn bad_inputs_are_errors() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((1, 4, 2, 8), DType::F32, &dev).unwrap();
    let table = Tensor::zeros((4, 4), DType::F32, &dev).unwrap();
    let short = Tensor::zeros((3, 4), DType::F32, &dev).unwrap();
    assert!(rope(&x, &table, &table).is_ok());
    expect_err(
        rope(&x, &short, &table),
        "`cos` must be [s, d / 2] = [4, 4] or [b, s, d / 2] for `x` [1, 4, 2, 8], got [3, 4]",
    );
    expect_err(
        rope(&x, &table, &short),
        "`sin` must be [s, d / 2] = [4, 4] or [b, s, d / 2] for `x` [1, 4, 2, 8], got [3, 4]",
    );
    expect_err(
        rope(&x.reshape((4, 2, 8)).unwrap(), &table, &table),
        "`x` must be [b, s, heads, d], got [4, 2, 8]",
    );
    let odd = Tensor::zeros((1, 4, 2, 7), DType::F32, &dev).unwrap();
    expect_err(
        rope(
            &odd,
            &Tensor::zeros((4, 3), DType::F32, &dev).unwrap(),
            &table,
        ),
        "the head dim of `x` [1, 4, 2, 7] must be even, got 7",
    );
}
