//! Shared helpers of the `ops_*` tests: a seeded RNG, tensor constructors, closeness checks and a
//! finite-difference gradient checker. Included by the other test files with `mod ops_util;`
//! (cargo also builds it as an empty test target of its own).
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Shape, Tensor, Var};

/// Step of the central finite differences (f64).
pub const FD_STEP: f64 = 1e-6;
/// Tolerance of analytic vs finite-difference gradients in f64: `|a - fd| <= TOL + TOL * |fd|`.
/// The central-difference truncation error is O(h²) ≈ 1e-12 and the rounding error about
/// 1e-16 · |loss| / h ≈ 1e-9 for these sizes, so 1e-6 leaves a wide margin yet catches any
/// wrong term of a gradient.
pub const FD_TOL: f64 = 1e-6;

/// A tiny deterministic xorshift64* generator.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[-1, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }

    /// A tensor of uniform values in `[-scale, scale)` of the given shape and dtype, on the cpu.
    pub fn tensor<S: Into<Shape>>(&mut self, shape: S, scale: f64, dtype: DType) -> Tensor {
        let shape: Shape = shape.into();
        let data: Vec<f64> = (0..shape.elem_count())
            .map(|_| self.uniform() * scale)
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .expect("random tensor")
    }
}

/// All elements of `t` as f64.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .expect("tensor values")
}

/// Asserts `|a - b| <= atol + rtol * |b|` elementwise (same shapes), naming `what` on failure.
pub fn assert_close(what: &str, a: &Tensor, b: &Tensor, rtol: f64, atol: f64) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes differ");
    let (av, bv) = (values(a), values(b));
    for (i, (x, y)) in av.iter().zip(&bv).enumerate() {
        assert!(
            (x - y).abs() <= atol + rtol * y.abs(),
            "{what}: element {i} differs: {x} vs {y} (rtol {rtol}, atol {atol})"
        );
    }
}

/// Output and input gradients of `loss = sum(f(inputs) * r)`, where only the inputs at
/// `with_grad` become `Var`s. Returns `(output, grads by with_grad order)`.
pub fn run_with_grads(
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    with_grad: &[usize],
    r: &Tensor,
) -> (Tensor, Vec<Tensor>) {
    let mut args: Vec<Tensor> = inputs.to_vec();
    let mut vars = Vec::new();
    for &i in with_grad {
        let var = Var::from_tensor(&inputs[i]).expect("var");
        args[i] = var.as_tensor().clone();
        vars.push(var);
    }
    let out = f(&args).expect("op forward");
    let loss = out
        .broadcast_mul(&r.to_dtype(out.dtype()).expect("r dtype"))
        .and_then(|t| t.sum_all())
        .expect("loss");
    let grads = loss.backward().expect("backward");
    let grads = vars
        .iter()
        .map(|v| {
            grads
                .get(v.as_tensor())
                .expect("every checked input has a gradient")
                .clone()
        })
        .collect();
    (out, grads)
}

/// Checks the gradients of `loss = sum(f(inputs) * r)` (r random, fixed by `seed`) with respect to
/// the f64 inputs at `checked` against central finite differences with step [`FD_STEP`] and
/// tolerance [`FD_TOL`]. Also asserts that each gradient is not all zero.
pub fn check_fd_grads(
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    checked: &[usize],
    seed: u64,
) {
    let out = f(inputs).expect("op forward");
    let r = Rng::new(seed).tensor(out.shape().clone(), 1.0, DType::F64);
    let (_, grads) = run_with_grads(f, inputs, checked, &r);
    let loss_at = |args: &[Tensor]| -> f64 {
        let out = f(args).expect("op forward");
        (out * &r)
            .and_then(|t| t.sum_all())
            .and_then(|t| t.to_scalar::<f64>())
            .expect("loss")
    };
    for (&i, grad) in checked.iter().zip(&grads) {
        assert_eq!(grad.dims(), inputs[i].dims(), "input {i}: gradient shape");
        let analytic = values(grad);
        assert!(
            analytic.iter().any(|&g| g != 0.0),
            "input {i}: gradient is all zero"
        );
        let base = values(&inputs[i]);
        let mut args = inputs.to_vec();
        for (e, &a) in analytic.iter().enumerate() {
            let mut at = |delta: f64| {
                let mut v = base.clone();
                v[e] += delta;
                args[i] = Tensor::from_vec(v, inputs[i].shape(), &Device::Cpu).expect("perturbed");
                loss_at(&args)
            };
            let fd = (at(FD_STEP) - at(-FD_STEP)) / (2.0 * FD_STEP);
            assert!(
                (a - fd).abs() <= FD_TOL + FD_TOL * fd.abs(),
                "input {i}, element {e}: analytic {a} vs finite difference {fd}"
            );
        }
    }
}

/// Checks `f` against the reference `reference` in `dtype`: outputs and the gradients of
/// `sum(out * r)` for the inputs at `with_grad`, within `|a - b| <= tol + tol * |b|`.
pub fn check_vs_reference(
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    with_grad: &[usize],
    tol: f64,
    seed: u64,
) {
    let out = reference(inputs).expect("reference forward");
    let r = Rng::new(seed).tensor(out.shape().clone(), 1.0, out.dtype());
    let (out_ref, grads_ref) = run_with_grads(reference, inputs, with_grad, &r);
    let (out_op, grads_op) = run_with_grads(f, inputs, with_grad, &r);
    assert_eq!(out_op.dtype(), out_ref.dtype(), "output dtype");
    assert_close("output", &out_op, &out_ref, tol, tol);
    for ((i, g_op), g_ref) in with_grad.iter().zip(&grads_op).zip(&grads_ref) {
        assert_close(&format!("gradient of input {i}"), g_op, g_ref, tol, tol);
    }
}
