//! Tests of `model::ops::grad_inject`: the injected gradient reaches the inputs exactly as the
//! gradient of `sum(y * g)` would, the result is a zero scalar, and shape mismatches are errors.

mod common;
use common::expect_err;

mod ops_util;

use candle_core::{DType, Device, Result, Tensor, Var};
use model::ops::{grad_inject, rms_norm, swiglu};
use ops_util::{assert_close, Rng};

/// Some graph `f(x, w)` built from primitives and library ops.
fn f(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let y = rms_norm(&x.exp()?, w, 1e-6)?;
    swiglu(&y, &x.tanh()?)
}

/// The gradients of `grad_inject(f(x, w), g)` equal those of `sum(f(x, w) * g)`, in f32 and f64
/// (identical arithmetic, so within 1e-12 relative); scaling the result scales the gradient.
#[test]
fn backward_equals_weighted_sum() {
    for dtype in [DType::F64, DType::F32] {
        let mut rng = Rng::new(1);
        let x = Var::from_tensor(&rng.tensor((3, 8), 1.0, dtype)).unwrap();
        let w = Var::from_tensor(&rng.tensor(8, 1.0, dtype)).unwrap();
        let g = rng.tensor((3, 8), 1.0, dtype);

        let y = f(&x, &w).unwrap();
        let inj = grad_inject(&y, &g).unwrap();
        assert_eq!(inj.dims(), &[] as &[usize]);
        assert_eq!(inj.dtype(), dtype);
        assert_eq!(
            inj.to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
            0.0
        );
        let got = inj.backward().unwrap();

        let want = (f(&x, &w).unwrap() * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for v in [&x, &w] {
            let (a, b) = (
                got.get(v.as_tensor()).unwrap(),
                want.get(v.as_tensor()).unwrap(),
            );
            assert_close("injected gradient", a, b, 1e-12, 0.0);
        }

        let scaled = (grad_inject(&f(&x, &w).unwrap(), &g).unwrap() * 3.0)
            .unwrap()
            .backward()
            .unwrap();
        let (a, b) = (
            scaled.get(x.as_tensor()).unwrap(),
            want.get(x.as_tensor()).unwrap(),
        );
        assert_close("scaled gradient", a, &(b * 3.0).unwrap(), 1e-6, 1e-12);
    }
}

/// A non-contiguous injected gradient works like its contiguous copy.
#[test]
fn non_contiguous_gradient() {
    let mut rng = Rng::new(2);
    let x = Var::from_tensor(&rng.tensor((4, 5), 1.0, DType::F32)).unwrap();
    let g = rng.tensor((5, 4), 1.0, DType::F32);
    let y = x.as_tensor().sqr().unwrap();
    let a = grad_inject(&y, &g.t().unwrap())
        .unwrap()
        .backward()
        .unwrap();
    let b = grad_inject(&y, &g.t().unwrap().contiguous().unwrap())
        .unwrap()
        .backward()
        .unwrap();
    assert_close(
        "dx",
        a.get(x.as_tensor()).unwrap(),
        b.get(x.as_tensor()).unwrap(),
        0.0,
        0.0,
    );
}

#[test]
fn shape_mismatch_is_an_error() {
    let dev = Device::Cpu;
    let y = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
    expect_err(
        grad_inject(&y, &Tensor::zeros((3, 2), DType::F32, &dev).unwrap()),
        "gradient shape [3, 2] does not match `y` shape [2, 3]",
    );
    expect_err(
        grad_inject(&y, &Tensor::zeros(6, DType::F32, &dev).unwrap()),
        "gradient shape [6] does not match `y` shape [2, 3]",
    );
    let u = y.to_dtype(DType::U32).unwrap();
    expect_err(grad_inject(&u, &u), "`y` must be a float tensor, got U32");
}
