//! Tests of `model::ops::rms_norm`: finite-difference gradients (f64), agreement with a
//! composition of candle primitives (f32, f64), non-contiguous input, half dtypes and errors.

mod common;
use common::expect_err;

mod ops_util;

use candle_core::{DType, Device, Result, Tensor, D};
use model::ops::rms_norm;
use ops_util::{assert_close, check_fd_grads, check_vs_reference, run_with_grads, Rng};

const EPS: f64 = 1e-5;

fn op(t: &[Tensor]) -> Result<Tensor> {
    rms_norm(&t[0], &t[1], EPS)
}

/// `x * (mean(x²) + eps)^-1/2 * w` from candle primitives.
fn reference(t: &[Tensor]) -> Result<Tensor> {
    let (x, w) = (&t[0], &t[1]);
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + EPS)?.sqrt()?.recip()?;
    x.broadcast_mul(&r)?.broadcast_mul(w)
}

fn inputs(rng: &mut Rng, dims: &[usize], dtype: DType) -> Vec<Tensor> {
    let h = *dims.last().unwrap();
    vec![
        rng.tensor(dims, 1.0, dtype),
        (rng.tensor(h, 0.5, dtype) + 1.0).unwrap(),
    ]
}

/// Analytic dx and dweight vs central finite differences, f64, tolerance 1e-6 (see `FD_TOL`).
#[test]
fn gradients_match_finite_differences() {
    let mut rng = Rng::new(1);
    check_fd_grads(&op, &inputs(&mut rng, &[2, 3, 7], DType::F64), &[0, 1], 11);
    check_fd_grads(&op, &inputs(&mut rng, &[5, 16], DType::F64), &[0, 1], 12);
}

/// Output and gradients vs the primitive composition: f64 within 1e-10, f32 within 1e-5.
#[test]
fn matches_primitive_composition() {
    let mut rng = Rng::new(2);
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
        for dims in [&[3, 5, 64][..], &[130, 33], &[1, 1]] {
            check_vs_reference(
                &op,
                &reference,
                &inputs(&mut rng, dims, dtype),
                &[0, 1],
                tol,
                21,
            );
        }
    }
}

/// A transposed (non-contiguous) `x` gives the same output and gradient as its contiguous copy.
#[test]
fn non_contiguous_input() {
    let mut rng = Rng::new(3);
    let base = rng.tensor((16, 6), 1.0, DType::F32); // [h, n]
    let w = rng.tensor(16, 1.0, DType::F32);
    let r = rng.tensor((6, 16), 1.0, DType::F32);
    let view = |t: &[Tensor]| rms_norm(&t[0].t()?, &t[1], EPS); // x = base^T: [n, h], strided
    let copy = |t: &[Tensor]| rms_norm(&t[0].t()?.contiguous()?, &t[1], EPS);
    let (o1, g1) = run_with_grads(&view, &[base.clone(), w.clone()], &[0, 1], &r);
    let (o2, g2) = run_with_grads(&copy, &[base, w], &[0, 1], &r);
    assert_close("output", &o1, &o2, 0.0, 0.0);
    assert_close("dx", &g1[0], &g2[0], 0.0, 0.0);
    assert_close("dweight", &g1[1], &g2[1], 0.0, 0.0);
}

/// bf16 and f16 inputs run through f32 and come back in their dtype, close to the f32 result.
#[test]
fn half_dtypes() {
    let mut rng = Rng::new(4);
    let t = inputs(&mut rng, &[4, 32], DType::F32);
    let want = op(&t).unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let half: Vec<Tensor> = t.iter().map(|x| x.to_dtype(dtype).unwrap()).collect();
        let got = op(&half).unwrap();
        assert_eq!(got.dtype(), dtype);
        assert_close("half output", &got, &want, 2e-2, 2e-2);
    }
}

#[test]
fn bad_inputs_are_errors() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
    expect_err(
        rms_norm(&x, &Tensor::ones(3, DType::F32, &dev).unwrap(), EPS),
        "`weight` must have shape [4] (the last dim of `x` [2, 4]), got [3]",
    );
    expect_err(
        rms_norm(&x, &Tensor::ones(4, DType::F64, &dev).unwrap(), EPS),
        "dtype mismatch, `x` is F32 but `weight` is F64",
    );
    expect_err(
        rms_norm(
            &x.to_dtype(DType::U32).unwrap(),
            &Tensor::ones(4, DType::U32, &dev).unwrap(),
            EPS,
        ),
        "`x` must be a float tensor (f32, f64, bf16, f16), got U32",
    );
    expect_err(
        rms_norm(
            &Tensor::new(1f32, &dev).unwrap(),
            &Tensor::ones(1, DType::F32, &dev).unwrap(),
            EPS,
        ),
        "`x` must have at least one dimension, got a scalar",
    );
}

/// The fused residual forms give the separate ops' results bit for bit: `add_rms_norm` equals
/// `add` then `rms_norm`, `rms_norm_bwd_add` equals `rms_norm_bwd` then `add` (the residual
/// first), in f32, f64 and bf16 (computed through f32 on the CPU), over rows longer than a
/// task's chunk and a short last chunk; shapes that disagree are refused by name.
#[test]
fn the_fused_residual_forms_equal_the_separate_ops_bit_for_bit() {
    use model::ops::{add, add_rms_norm, rms_norm_bwd, rms_norm_bwd_add};
    let mut rng = Rng::new(7);
    let bits = |t: &Tensor| -> Vec<u64> {
        let v = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
        v.to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        for dims in [(3usize, 300, 48), (2, 4, 300)] {
            let h = dims.2;
            let (x, o, g, res) = (
                rng.tensor(dims, 1.0, dtype),
                rng.tensor(dims, 1.0, dtype),
                rng.tensor(dims, 1.0, dtype),
                rng.tensor(dims, 1.0, dtype),
            );
            let w = (rng.tensor(h, 0.5, dtype) + 1.0).unwrap();
            let (s, y) = add_rms_norm(&x, &o, &w, EPS).unwrap();
            let s_ref = add(&x, &o).unwrap();
            let y_ref = rms_norm(&s_ref, &w, EPS).unwrap();
            let what = format!("{dtype:?} {dims:?}");
            assert_eq!(
                (s.dims3().unwrap(), y.dims3().unwrap()),
                (dims, dims),
                "{what}"
            );
            assert_eq!(bits(&s), bits(&s_ref), "{what}: the sum");
            assert_eq!(bits(&y), bits(&y_ref), "{what}: its norm");

            let (dx, dw) = rms_norm_bwd_add(&s, &w, EPS, &g, &res).unwrap();
            let (dx_ref, dw_ref) = rms_norm_bwd(&s, &w, EPS, &g).unwrap();
            let dx_ref = add(&res, &dx_ref).unwrap();
            assert_eq!(bits(&dx), bits(&dx_ref), "{what}: dx");
            assert_eq!(bits(&dw), bits(&dw_ref), "{what}: dweight");
        }
    }
    let (x, w) = (
        rng.tensor((2, 8), 1.0, DType::F32),
        rng.tensor(8, 1.0, DType::F32),
    );
    let short = rng.tensor((2, 4), 1.0, DType::F32);
    expect_err(
        add_rms_norm(&x, &x.narrow(1, 0, 4).unwrap(), &w, EPS),
        "`o` is [2, 4]",
    );
    expect_err(
        rms_norm_bwd_add(&x, &w, EPS, &x, &short),
        "residual gradient is [2, 4]",
    );
}
