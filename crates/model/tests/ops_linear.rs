//! Tests of `model::ops::linear` and `linear_to`: bit-identical to the composition of candle
//! primitives they replace (output, `dx`, `dw`; f32 and f64; 2-D, 3-D and 4-D `x`, non-contiguous
//! `x`), finite-difference gradients (f64), and errors.

mod common;
use common::expect_err;

mod ops_util;

use candle_core::{DType, Device, Result, Tensor};
use model::ops::{linear, linear_to};
use ops_util::{check_fd_grads, run_with_grads, values, Rng};

fn op(t: &[Tensor]) -> Result<Tensor> {
    linear(&t[0], &t[1])
}

/// `x · wᵀ` as reshape, transpose, matmul and reshape.
fn composed(t: &[Tensor]) -> Result<Tensor> {
    let (x, w) = (&t[0], &t[1]);
    let dims = x.dims().to_vec();
    let n_in = *dims.last().unwrap();
    let rows = x.elem_count() / n_in;
    let y = x.reshape((rows, n_in))?.matmul(&w.t()?)?;
    let mut out = dims;
    *out.last_mut().unwrap() = w.dim(0)?;
    y.reshape(out)
}

/// The same GEMMs (`dw` as `gᵀ · x` instead of `(xᵀ · g)ᵀ`, the same dot products): output and
/// both gradients equal bit for bit on the CPU.
#[test]
fn equals_the_primitive_composition_bit_for_bit() {
    let mut rng = Rng::new(3);
    for dtype in [DType::F32, DType::F64] {
        for x_shape in [vec![37, 24], vec![2, 19, 24]] {
            let t = vec![
                rng.tensor(x_shape.as_slice(), 1.0, dtype),
                rng.tensor((40, 24), 0.5, dtype),
            ];
            let r = rng.tensor(
                [&x_shape[..x_shape.len() - 1], &[40]].concat().as_slice(),
                1.0,
                dtype,
            );
            let (y, g) = run_with_grads(&op, &t, &[0, 1], &r);
            let (y_ref, g_ref) = run_with_grads(&composed, &t, &[0, 1], &r);
            assert_eq!(y.dims(), y_ref.dims());
            assert_eq!(values(&y), values(&y_ref), "{dtype:?} {x_shape:?} output");
            assert_eq!(values(&g[0]), values(&g_ref[0]), "{dtype:?} {x_shape:?} dx");
            assert_eq!(values(&g[1]), values(&g_ref[1]), "{dtype:?} {x_shape:?} dw");
            assert!(g[1].is_contiguous(), "the weight gradient is contiguous");
        }
    }
}

/// `linear_to` on attention's `[b, s, heads, d]` layout, in and out, equals reshape → linear →
/// reshape bit for bit (output and both gradients).
#[test]
fn linear_to_equals_reshapes_around_linear() {
    let mut rng = Rng::new(6);
    for dtype in [DType::F32, DType::F64] {
        let t = vec![
            rng.tensor((2, 5, 3, 4), 1.0, dtype), // [b, s, heads, d], in = 12
            rng.tensor((6, 12), 0.5, dtype),      // out = 2 heads of 3
        ];
        let r = rng.tensor((2, 5, 2, 3), 1.0, dtype);
        let fused = |t: &[Tensor]| linear_to(&t[0], &t[1], (2, 5, 2, 3));
        let composed = |t: &[Tensor]| {
            composed(&[t[0].reshape((2, 5, 12))?, t[1].clone()])?.reshape((2, 5, 2, 3))
        };
        let (y, g) = run_with_grads(&fused, &t, &[0, 1], &r);
        let (y_ref, g_ref) = run_with_grads(&composed, &t, &[0, 1], &r);
        assert_eq!(y.dims(), &[2, 5, 2, 3]);
        assert_eq!(values(&y), values(&y_ref), "{dtype:?} output");
        assert_eq!(g[0].dims(), &[2, 5, 3, 4]);
        assert_eq!(values(&g[0]), values(&g_ref[0]), "{dtype:?} dx");
        assert_eq!(values(&g[1]), values(&g_ref[1]), "{dtype:?} dw");
    }
}

/// Analytic dx and dw vs central finite differences, f64.
#[test]
fn gradients_match_finite_differences() {
    let mut rng = Rng::new(4);
    let t = vec![
        rng.tensor((2, 3, 5), 1.0, DType::F64),
        rng.tensor((4, 5), 1.0, DType::F64),
    ];
    check_fd_grads(&op, &t, &[0, 1], 5);
}

/// A transposed (non-contiguous) `x` gives the result of its contiguous copy.
#[test]
fn non_contiguous_input() -> Result<()> {
    let mut rng = Rng::new(5);
    let xt = rng.tensor((6, 9), 1.0, DType::F32).t()?; // [9, 6], strided
    let w = rng.tensor((4, 6), 1.0, DType::F32);
    assert!(!xt.is_contiguous());
    let a = linear(&xt, &w)?;
    let b = linear(&xt.contiguous()?, &w)?;
    assert_eq!(values(&a), values(&b));
    Ok(())
}

#[test]
fn mismatched_shapes_are_errors() {
    let x = Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap();
    expect_err(
        linear(
            &x,
            &Tensor::zeros((4, 6), DType::F32, &Device::Cpu).unwrap(),
        ),
        "x has 5 features but w is [4, 6]",
    );
    expect_err(
        linear(&x, &Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap()),
        "expected x [.., in] and w [out, in]",
    );
    let w = Tensor::zeros((4, 5), DType::F32, &Device::Cpu).unwrap();
    expect_err(
        linear_to(&x, &w, (3, 5)),
        "output shape [3, 5] does not hold the 3 x 4 products",
    );
    expect_err(
        linear_to(&Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap(), &w, 4),
        "is not a whole number of rows of the 5 features",
    );
}
