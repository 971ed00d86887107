//! Tests of `model::ops::causal_attention`: finite-difference gradients (f64), agreement with an
//! explicit `softmax(Q K^T · scale + causal mask) · V` built from candle primitives (f32, f64)
//! for GQA and plain heads and sequence lengths that straddle the kernel's row blocks, `s = 1`,
//! non-contiguous inputs, half dtypes and errors; the cuDNN backend's entry points on the CPU;
//! plus an ignored timing run.

mod common;
use common::expect_err;

mod ops_util;

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var, D};
use model::ops::causal_attention;
use ops_util::{assert_close, check_fd_grads, check_vs_reference, run_with_grads, values, Rng};

/// `[b, s, hq, d]` query, `[b, s, hkv, d]` key and value, uniform in [-1, 1).
fn inputs(
    rng: &mut Rng,
    (b, s, hq, hkv, d): (usize, usize, usize, usize, usize),
    dtype: DType,
) -> Vec<Tensor> {
    vec![
        rng.tensor((b, s, hq, d), 1.0, dtype),
        rng.tensor((b, s, hkv, d), 1.0, dtype),
        rng.tensor((b, s, hkv, d), 1.0, dtype),
    ]
}

fn op(scale: f64) -> impl Fn(&[Tensor]) -> Result<Tensor> {
    move |t: &[Tensor]| causal_attention(&t[0], &t[1], &t[2], scale)
}

/// `[b, s, hkv, d]` -> `[b, hq, s, d]`, each kv head repeated for its `hq / hkv` query heads.
fn repeat_kv(x: &Tensor, hq: usize) -> Result<Tensor> {
    let (b, s, hkv, d) = x.dims4()?;
    let x = x.transpose(1, 2)?.unsqueeze(2)?; // [b, hkv, 1, s, d]
    x.broadcast_as((b, hkv, hq / hkv, s, d))?
        .reshape((b, hq, s, d))
}

/// Explicit attention from candle primitives: full `[b, hq, s, s]` scores, a `-inf` mask above
/// the diagonal, softmax via exp / sum.
fn reference(scale: f64) -> impl Fn(&[Tensor]) -> Result<Tensor> {
    move |t: &[Tensor]| {
        let (b, s, hq, d) = t[0].dims4()?;
        let q = t[0].transpose(1, 2)?.contiguous()?; // [b, hq, s, d]
        let k = repeat_kv(&t[1], hq)?; // [b, hq, s, d]
        let v = repeat_kv(&t[2], hq)?; // [b, hq, s, d]
        let mask: Vec<f64> = (0..s * s)
            .map(|i| {
                if i % s > i / s {
                    f64::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (s, s), q.device())?.to_dtype(q.dtype())?;
        let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?; // [b, hq, s, s]
        let max = scores.max_keepdim(D::Minus1)?.detach();
        let e = scores.broadcast_sub(&max)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let out = p.matmul(&v)?; // [b, hq, s, d]
        out.transpose(1, 2)?.contiguous()?.reshape((b, s, hq, d))
    }
}

/// dq, dk, dv vs central finite differences, f64, tolerance 1e-6 (see `FD_TOL`): GQA with
/// hq = 4, hkv = 2, d = 8 and plain heads with d = 16.
#[test]
fn gradients_match_finite_differences() {
    let mut rng = Rng::new(1);
    check_fd_grads(
        &op(0.7),
        &inputs(&mut rng, (2, 5, 4, 2, 8), DType::F64),
        &[0, 1, 2],
        11,
    );
    check_fd_grads(
        &op(0.25),
        &inputs(&mut rng, (2, 3, 2, 2, 16), DType::F64),
        &[0, 1, 2],
        12,
    );
}

/// Output and all gradients vs the explicit reference: f64 within 1e-10, f32 within 1e-4.
/// Sequence lengths 67 and 130 are not multiples of the kernel's 64-row blocks (nor of 2^k).
#[test]
fn matches_primitive_composition() {
    let mut rng = Rng::new(2);
    let cases = [
        (2, 67, 4, 2, 16),
        (2, 130, 2, 2, 8),
        (2, 7, 4, 1, 8),
        (1, 1, 4, 2, 16),
    ];
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-4)] {
        for dims in cases {
            let scale = 1.0 / (dims.4 as f64).sqrt();
            let t = inputs(&mut rng, dims, dtype);
            check_vs_reference(&op(scale), &reference(scale), &t, &[0, 1, 2], tol, 21);
        }
    }
}

/// `s = 1`: finite output equal to the (repeated) values, finite gradients.
#[test]
fn single_position_has_no_nan() {
    let mut rng = Rng::new(3);
    let t = inputs(&mut rng, (2, 1, 4, 2, 8), DType::F32);
    let r = rng.tensor((2, 1, 4, 8), 1.0, DType::F32);
    let (out, grads) = run_with_grads(&op(0.35), &t, &[0, 1, 2], &r);
    let want = repeat_kv(&t[2], 4).unwrap().transpose(1, 2).unwrap();
    assert_close("output", &out, &want, 0.0, 0.0);
    for g in &grads {
        assert!(values(g).iter().all(|x| x.is_finite()));
    }
}

/// q, k, v as narrowed views of one fused `[b, s, hq + 2 hkv, d]` projection give the same output
/// and gradients as contiguous copies.
#[test]
fn non_contiguous_inputs() {
    let mut rng = Rng::new(4);
    let qkv = rng.tensor((2, 9, 8, 8), 1.0, DType::F32);
    let r = rng.tensor((2, 9, 4, 8), 1.0, DType::F32);
    let split = |t: &Tensor, copy: bool| -> Result<Vec<Tensor>> {
        let parts = [t.narrow(2, 0, 4)?, t.narrow(2, 4, 2)?, t.narrow(2, 6, 2)?];
        parts
            .into_iter()
            .map(|p| if copy { p.contiguous() } else { Ok(p) })
            .collect()
    };
    let view = |t: &[Tensor]| op(0.3)(&split(&t[0], false)?);
    let copy = |t: &[Tensor]| op(0.3)(&split(&t[0], true)?);
    let (o1, g1) = run_with_grads(&view, std::slice::from_ref(&qkv), &[0], &r);
    let (o2, g2) = run_with_grads(&copy, &[qkv], &[0], &r);
    assert_close("output", &o1, &o2, 0.0, 0.0);
    assert_close("d qkv", &g1[0], &g2[0], 0.0, 0.0);
}

/// bf16 runs through f32 and returns bf16 close to the f32 result.
#[test]
fn bf16_runs_through_f32() {
    let mut rng = Rng::new(5);
    let t = inputs(&mut rng, (1, 10, 2, 1, 8), DType::F32);
    let want = op(0.35)(&t).unwrap();
    let half: Vec<Tensor> = t.iter().map(|x| x.to_dtype(DType::BF16).unwrap()).collect();
    let got = op(0.35)(&half).unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    assert_close("bf16 output", &got, &want, 3e-2, 3e-2);
}

/// On the CPU the cuDNN backend's entry points run the project's kernels: the same results bit
/// for bit, for causal calls, unmasked ring blocks with more or fewer keys, and both backwards.
#[test]
fn the_cudnn_backend_runs_the_projects_kernels_on_the_cpu() -> Result<()> {
    use model::ops::{self, cudnn};
    let same = |a: &Tensor, b: &Tensor| -> Result<()> {
        let (a, b) = (values(a), values(b));
        assert!(a == b, "results differ");
        Ok(())
    };
    let mut rng = Rng::new(11);
    for dtype in [DType::F32, DType::BF16] {
        let t = inputs(&mut rng, (2, 9, 4, 2, 8), dtype);
        let (q, k, v) = (&t[0], &t[1], &t[2]);
        let own = ops::causal_attention_saved(q, k, v, 0.3, None)?;
        let cud = cudnn::causal_attention_saved::<true>(q, k, v, 0.3, None)?;
        same(&own.0, &cud.0)?;
        same(&own.1, &cud.1)?;
        let dout = rng.tensor(q.dims(), 1.0, dtype);
        let a = ops::causal_attention_bwd(q, k, v, (&own.0, &own.1), &dout, 0.3, None)?;
        let b = cudnn::causal_attention_bwd::<true>(q, k, v, (&own.0, &own.1), &dout, 0.3, None)?;
        // The non-deterministic backward is cuDNN's only: on the CPU the same kernels run.
        let c = cudnn::causal_attention_bwd::<false>(q, k, v, (&own.0, &own.1), &dout, 0.3, None)?;
        for (x, y) in [
            (&a.0, &b.0),
            (&a.1, &b.1),
            (&a.2, &b.2),
            (&a.0, &c.0),
            (&a.2, &c.2),
        ] {
            same(x, y)?;
        }
        for sk in [5, 13] {
            let k = rng.tensor((2, sk, 2, 8), 1.0, dtype);
            let v = rng.tensor((2, sk, 2, 8), 1.0, dtype);
            let own = ops::attention_block(q, &k, &v, 0.3, false, None)?;
            let cud = cudnn::attention_block::<true>(q, &k, &v, 0.3, false, None)?;
            same(&own.0, &cud.0)?;
            same(&own.1, &cud.1)?;
            let (o, l) = (&own.0, &own.1);
            let a = ops::attention_block_bwd(q, &k, &v, o, &dout, l, 0.3, false, None)?;
            let b = cudnn::attention_block_bwd::<true>(q, &k, &v, o, &dout, l, 0.3, false, None)?;
            for (x, y) in [(&a.0, &b.0), (&a.1, &b.1), (&a.2, &b.2)] {
                same(x, y)?;
            }
        }
    }
    Ok(())
}

#[test]
fn bad_inputs_are_errors() {
    let dev = Device::Cpu;
    let z = |dims: &[usize], dt: DType| Tensor::zeros(dims, dt, &dev).unwrap();
    let q = z(&[1, 4, 3, 8], DType::F32);
    let kv = z(&[1, 4, 3, 8], DType::F32);
    assert!(causal_attention(&q, &kv, &kv, 1.0).is_ok());
    let kv2 = z(&[1, 4, 2, 8], DType::F32);
    expect_err(
        causal_attention(&q, &kv2, &kv2, 1.0),
        "query heads 3 must be a multiple of kv heads 2",
    );
    let kd = z(&[1, 4, 3, 4], DType::F32);
    expect_err(
        causal_attention(&q, &kd, &kd, 1.0),
        "`k` [1, 4, 3, 4] does not match `q` [1, 4, 3, 8] in b, s or d",
    );
    let ks = z(&[1, 5, 3, 8], DType::F32);
    expect_err(
        causal_attention(&q, &ks, &ks, 1.0),
        "`k` [1, 5, 3, 8] does not match `q` [1, 4, 3, 8] in b, s or d",
    );
    expect_err(
        causal_attention(&q, &kv, &kv2, 1.0),
        "`v` [1, 4, 2, 8] must have the shape of `k` [1, 4, 3, 8]",
    );
    expect_err(
        causal_attention(&q, &kv.to_dtype(DType::F64).unwrap(), &kv, 1.0),
        "dtype mismatch, `q` is F32 but `k` is F64",
    );
    expect_err(
        causal_attention(&q.squeeze(0).unwrap(), &kv, &kv, 1.0),
        "`q` must be [b, s, hq, d], got [4, 3, 8]",
    );
    expect_err(
        causal_attention(&q, &kv, &kv, f64::NAN),
        "`scale` must be finite, got NaN",
    );
}

/// Timing of forward + backward for b = 4, s = 128, hq = 4, hkv = 2, d = 32 in f32 (and the
/// explicit reference for comparison). Run with `--ignored --nocapture`.
#[test]
#[ignore]
fn timing() {
    let mut rng = Rng::new(6);
    let t = inputs(&mut rng, (4, 128, 4, 2, 32), DType::F32);
    let vars: Vec<Var> = t.iter().map(|x| Var::from_tensor(x).unwrap()).collect();
    let args: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let scale = 1.0 / 32f64.sqrt();
    for (name, f) in [
        ("fused", &op(scale) as &dyn Fn(&[Tensor]) -> Result<Tensor>),
        ("reference", &reference(scale)),
    ] {
        let (iters, warmup) = (20, 2);
        let (mut fwd, mut total) = (0.0, 0.0);
        for i in 0..warmup + iters {
            let start = Instant::now();
            let out = f(&args).unwrap();
            let mid = start.elapsed().as_secs_f64();
            out.sum_all().unwrap().backward().unwrap();
            if i >= warmup {
                fwd += mid;
                total += start.elapsed().as_secs_f64();
            }
        }
        let n = iters as f64;
        println!(
            "{name}: forward {:.3} ms, forward+backward {:.3} ms",
            fwd / n * 1e3,
            total / n * 1e3
        );
    }
}
