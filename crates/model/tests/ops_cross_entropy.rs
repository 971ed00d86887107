//! Tests of `model::ops::cross_entropy`: finite-difference gradients (f64), agreement with a
//! composition of candle primitives (f32, f64), non-contiguous logits and errors.

mod common;
use common::expect_err;

mod ops_util;

use candle_core::{DType, Device, Result, Tensor, D};
use model::ops::cross_entropy;
use ops_util::{assert_close, check_fd_grads, check_vs_reference, run_with_grads, Rng};

fn op(t: &[Tensor]) -> Result<Tensor> {
    cross_entropy(&t[0], &t[1])
}

/// `logsumexp(logits) - logits[target]` from candle primitives.
fn reference(t: &[Tensor]) -> Result<Tensor> {
    let (logits, targets) = (&t[0], &t[1]);
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let lse = (logits
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + max)?;
    let picked = logits.gather(&targets.unsqueeze(1)?, 1)?;
    (lse - picked)?.squeeze(1)
}

fn inputs(rng: &mut Rng, n: usize, v: usize, dtype: DType) -> Vec<Tensor> {
    let targets: Vec<u32> = (0..n).map(|_| (rng.next_u64() % v as u64) as u32).collect();
    vec![
        rng.tensor((n, v), 4.0, dtype),
        Tensor::from_vec(targets, n, &Device::Cpu).unwrap(),
    ]
}

/// Analytic dlogits vs central finite differences, f64, tolerance 1e-6 (see `FD_TOL`).
#[test]
fn gradients_match_finite_differences() {
    let mut rng = Rng::new(1);
    check_fd_grads(&op, &inputs(&mut rng, 5, 9, DType::F64), &[0], 11);
}

/// Output and dlogits vs the primitive composition: f64 within 1e-12, f32 within 1e-5.
#[test]
fn matches_primitive_composition() {
    let mut rng = Rng::new(2);
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        for (n, v) in [(7, 13), (33, 1000), (1, 1)] {
            check_vs_reference(
                &op,
                &reference,
                &inputs(&mut rng, n, v, dtype),
                &[0],
                tol,
                21,
            );
        }
    }
}

/// Large logits do not overflow: the loss of a confident correct row is ~0.
#[test]
fn large_logits_are_stable() {
    let logits = Tensor::new(&[[1000f32, 0.0, -1000.0]], &Device::Cpu).unwrap();
    let targets = Tensor::new(&[0u32], &Device::Cpu).unwrap();
    let loss = cross_entropy(&logits, &targets)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(loss[0].abs() < 1e-6, "{loss:?}");
}

/// Transposed logits give the same losses and gradient as a contiguous copy.
#[test]
fn non_contiguous_input() {
    let mut rng = Rng::new(3);
    let mut t = inputs(&mut rng, 6, 10, DType::F32);
    t[0] = t[0].t().unwrap().contiguous().unwrap(); // stored [v, n]
    let r = rng.tensor(6, 1.0, DType::F32);
    let view = |t: &[Tensor]| cross_entropy(&t[0].t()?, &t[1]);
    let copy = |t: &[Tensor]| cross_entropy(&t[0].t()?.contiguous()?, &t[1]);
    let (o1, g1) = run_with_grads(&view, &t, &[0], &r);
    let (o2, g2) = run_with_grads(&copy, &t, &[0], &r);
    assert_close("loss", &o1, &o2, 0.0, 0.0);
    assert_close("dlogits", &g1[0], &g2[0], 0.0, 0.0);
}

#[test]
fn bad_inputs_are_errors() {
    let dev = Device::Cpu;
    let logits = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
    let out_of_range = Tensor::new(&[1u32, 4], &dev).unwrap();
    let err = cross_entropy(&logits, &out_of_range)
        .unwrap_err()
        .to_string();
    assert!(err.contains("out of range"), "{err}");
    expect_err(
        cross_entropy(&logits, &Tensor::new(&[1u32, 2, 3], &dev).unwrap()),
        "`targets` must be [n] = [2] for `logits` [2, 4], got [3]",
    );
    expect_err(
        cross_entropy(&logits, &Tensor::new(&[1i64, 2], &dev).unwrap()),
        "`targets` must be u32, got I64",
    );
    expect_err(
        cross_entropy(
            &logits.flatten_all().unwrap(),
            &Tensor::new(&[1u32], &dev).unwrap(),
        ),
        "`logits` must be [n, v], got [8]",
    );
}
