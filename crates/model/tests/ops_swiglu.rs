//! Tests of `model::ops::swiglu`: finite-difference gradients (f64), agreement with a
//! composition of candle primitives (f32, f64), non-contiguous input and errors.

mod common;
use common::expect_err;

mod ops_util;

use candle_core::{DType, Device, Result, Tensor};
use model::ops::swiglu;
use ops_util::{assert_close, check_fd_grads, check_vs_reference, run_with_grads, Rng};

fn op(t: &[Tensor]) -> Result<Tensor> {
    swiglu(&t[0], &t[1])
}

/// `gate / (1 + exp(-gate)) * up` from candle primitives.
fn reference(t: &[Tensor]) -> Result<Tensor> {
    let (gate, up) = (&t[0], &t[1]);
    let sigmoid = (gate.neg()?.exp()? + 1.0)?.recip()?;
    (gate * sigmoid)? * up
}

/// Analytic d gate and d up vs central finite differences, f64, tolerance 1e-6 (see `FD_TOL`).
#[test]
fn gradients_match_finite_differences() {
    let mut rng = Rng::new(1);
    let t = vec![
        rng.tensor((3, 11), 4.0, DType::F64),
        rng.tensor((3, 11), 2.0, DType::F64),
    ];
    check_fd_grads(&op, &t, &[0, 1], 11);
}

/// Output and gradients vs the primitive composition: f64 within 1e-12, f32 within 1e-5.
/// The large shape spans several rayon chunks.
#[test]
fn matches_primitive_composition() {
    let mut rng = Rng::new(2);
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        for dims in [&[2, 3, 5][..], &[40_000], &[1]] {
            let t = vec![rng.tensor(dims, 6.0, dtype), rng.tensor(dims, 2.0, dtype)];
            check_vs_reference(&op, &reference, &t, &[0, 1], tol, 21);
        }
    }
}

/// Transposed views give the same output and gradients as contiguous copies.
#[test]
fn non_contiguous_input() {
    let mut rng = Rng::new(3);
    let t = vec![
        rng.tensor((7, 9), 3.0, DType::F32),
        rng.tensor((9, 7), 1.0, DType::F32),
    ];
    let r = rng.tensor((9, 7), 1.0, DType::F32);
    let view = |t: &[Tensor]| swiglu(&t[0].t()?, &t[1]);
    let copy = |t: &[Tensor]| swiglu(&t[0].t()?.contiguous()?, &t[1]);
    let (o1, g1) = run_with_grads(&view, &t, &[0, 1], &r);
    let (o2, g2) = run_with_grads(&copy, &t, &[0, 1], &r);
    assert_close("output", &o1, &o2, 0.0, 0.0);
    assert_close("d gate", &g1[0], &g2[0], 0.0, 0.0);
    assert_close("d up", &g1[1], &g2[1], 0.0, 0.0);
}

#[test]
fn bad_inputs_are_errors() {
    let dev = Device::Cpu;
    let a = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
    expect_err(
        swiglu(&a, &Tensor::zeros((4, 2), DType::F32, &dev).unwrap()),
        "shape mismatch, `gate` is [2, 4] but `up` is [4, 2]",
    );
    expect_err(
        swiglu(&a, &a.to_dtype(DType::F64).unwrap()),
        "dtype mismatch, `gate` is F32 but `up` is F64",
    );
    let u = a.to_dtype(DType::U32).unwrap();
    expect_err(
        swiglu(&u, &u),
        "`gate` must be a float tensor (f32, f64, bf16, f16), got U32",
    );
}

/// On the fused gate/up GEMM's output `[.., 2f]` (each row's gate, then its up), the joined op
/// and its backward give `swiglu` and `swiglu_bwd` of the two halves bit for bit, the gradient
/// in the joined layout.
#[test]
fn the_joined_layout_gives_the_halves_results_bit_for_bit() -> Result<()> {
    let mut rng = Rng::new(5);
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let gu = rng
            .tensor((2, 5, 2 * 37), 3.0, DType::F32)
            .to_dtype(dtype)?;
        let dy = rng.tensor((2, 5, 37), 1.0, DType::F32).to_dtype(dtype)?;
        let (gate, up) = (gu.narrow(2, 0, 37)?, gu.narrow(2, 37, 37)?);
        let bits =
            |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(DType::F64)?.flatten_all()?.to_vec1() };
        let y = model::ops::swiglu_joined(&gu)?;
        assert_eq!((y.dims(), y.dtype()), (&[2, 5, 37][..], dtype));
        assert_eq!(bits(&y)?, bits(&swiglu(&gate, &up)?)?, "{dtype:?} forward");
        let d = model::ops::swiglu_joined_bwd(&gu, &dy)?;
        let (dg, du) = model::ops::swiglu_bwd(&gate, &up, &dy)?;
        assert_eq!(bits(&d.narrow(2, 0, 37)?)?, bits(&dg)?, "{dtype:?} d gate");
        assert_eq!(bits(&d.narrow(2, 37, 37)?)?, bits(&du)?, "{dtype:?} d up");
    }
    let odd = Tensor::zeros((3, 5), DType::F32, &Device::Cpu)?;
    expect_err(model::ops::swiglu_joined(&odd), "gate|up must be [.., 2f]");
    let gu = Tensor::zeros((3, 8), DType::F32, &Device::Cpu)?;
    expect_err(
        model::ops::swiglu_joined_bwd(&gu, &odd),
        "grad [3, 5] is not half of gate|up [3, 8]",
    );
    Ok(())
}
