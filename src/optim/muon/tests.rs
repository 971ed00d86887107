//! Muon against `torch.optim.Muon` (`torch_reference.json`, written by
//! `scripts/make_muon_reference.py`: torch's own code with its iteration in f32), and the split
//! of a rank's elements between Muon and AdamW.

use candle_core::{DType, Device, Tensor};
use model::init::Init;
use model::{ParamKind, ParamSet};
use parallel::tp::TensorParallel;

use super::*;
use crate::optim::{layout_of, GradBuffer, Optimizer};
use crate::recipe::{OptimizerConfig, OptimizerName, StateDtype};

/// The reference's formula for initial values (`kind` 0) and step `t`'s gradients (1).
fn value(kind: u8, t: usize, i: usize, j: usize) -> f32 {
    let (i, j, tf) = (i as f64, j as f64, t as f64);
    let v = if kind == 0 {
        0.1 * (0.37 * i + 0.11 * j + 0.5).sin()
    } else {
        (0.29 * i * ((t % 3) + 1) as f64 + 0.13 * j + 0.7 * tf).sin() * (1.0 + 0.25 * tf)
    };
    v as f32
}

fn matrix_values(kind: u8, t: usize, [rows, cols]: [usize; 2]) -> Tensor {
    let v: Vec<f32> = (0..rows * cols)
        .map(|k| value(kind, t, k / cols, k % cols))
        .collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
}

fn config(case: &serde_json::Value) -> OptimizerConfig {
    let f = |k: &str| case[k].as_f64().unwrap();
    let c: Vec<f64> = case["ns_coefficients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    OptimizerConfig {
        lr: f("lr"),
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: f("weight_decay"),
        decay_embeddings: false,
        state_dtype: StateDtype::Fp32,
        name: OptimizerName::Muon,
        muon: MuonConfig {
            momentum: f("momentum"),
            nesterov: case["nesterov"].as_bool().unwrap(),
            ns_steps: case["ns_steps"].as_u64().unwrap() as usize,
            ns_coefficients: [c[0], c[1], c[2]],
            eps: f("eps"),
            adjust_lr: match case["adjust_lr"].as_str().unwrap() {
                "original" => AdjustLr::Original,
                _ => AdjustLr::MatchRmsAdamw,
            },
        },
        offload: Default::default(),
        offload_threads: 0,
    }
}

/// A norm gain `[4]` and a hidden matrix of `shape`, on one rank, under `cfg`.
fn one_rank(shape: [usize; 2], cfg: &OptimizerConfig) -> (ParamSet, Optimizer) {
    let mut ps = ParamSet::default();
    let tp = TensorParallel::single();
    for (name, kind, global) in [
        ("model.norm.weight", ParamKind::Norm, vec![4]),
        ("w", ParamKind::Matrix, shape.to_vec()),
    ] {
        let spec = model::ParamSpec {
            name,
            global_shape: &global,
            kind,
            init: Init::Normal { std: 1.0 },
        };
        ps.add(spec, 3, &tp, DType::F32, &Device::Cpu).unwrap();
    }
    ps.get(1).set(&matrix_values(0, 0, shape)).unwrap();
    let layout = layout_of(&ps, parallel::config::DEFAULT_BUCKET_SIZE, 1);
    let opt = Optimizer::single_rank(&ps, &layout, cfg, &[false, true]).unwrap();
    (ps, opt)
}

/// Ten steps of ours equal torch.optim.Muon's on a wide, a tall and a square matrix (Nesterov
/// or not, both learning-rate adjustments, both sides of torch's `lerp`, other coefficients
/// and step counts) within 1e-6; the norm gain beside it is updated by AdamW exactly as an
/// AdamW-only optimizer updates it.
#[test]
fn ten_steps_equal_torch_optim_muon() {
    let reference: serde_json::Value =
        serde_json::from_str(include_str!("torch_reference.json")).unwrap();
    for case in reference["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let s: Vec<usize> = case["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        let shape = [s[0], s[1]];
        let cfg = config(case);
        let (ps, mut opt) = one_rank(shape, &cfg);
        let adamw_cfg = OptimizerConfig {
            name: OptimizerName::AdamW,
            ..cfg.clone()
        };
        let layout = layout_of(&ps, parallel::config::DEFAULT_BUCKET_SIZE, 1);
        let mut adamw_only =
            Optimizer::single_rank(&ps, &layout, &adamw_cfg, &[false, true]).unwrap();
        let grads = GradBuffer::new(layout.clone(), &Device::Cpu).unwrap();
        let mut worst = 0f32;
        for (t, want) in case["after"].as_array().unwrap().iter().enumerate() {
            grads.zero().unwrap();
            let norm_grad = Tensor::new(&[0.5f32, -1.0, 2.0, 0.25], &Device::Cpu).unwrap();
            grads
                .accumulate(0, &norm_grad.affine(t as f64 + 1.0, 0.0).unwrap())
                .unwrap();
            grads
                .accumulate(1, &matrix_values(1, t + 1, shape))
                .unwrap();
            opt.step(&grads, cfg.lr, 1.0).unwrap();
            adamw_only.step(&grads, cfg.lr, 1.0).unwrap();
            let ours = opt.master().unwrap().to_vec1::<f32>().unwrap();
            for (k, w) in want.as_array().unwrap().iter().enumerate() {
                let d = (ours[4 + k] - w.as_f64().unwrap() as f32).abs();
                worst = worst.max(d);
            }
            let alone = adamw_only.master().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(
                ours[..4],
                alone[..4],
                "{name}: AdamW's part, step {}",
                t + 1
            );
        }
        eprintln!("{name}: max |ours − torch| over 10 steps {worst:.2e}");
        assert!(worst < 1e-6, "{name}: differs from torch by {worst:.2e}");
        // Muon keeps 8 bytes per matrix element, AdamW 12 per other element (padding included).
        let n = shape[0] * shape[1];
        assert_eq!(opt.state_bytes(), 8 * n + 12 * (layout.total - n));
    }
}

#[test]
fn learning_rate_ratios_follow_torch() {
    assert_eq!(lr_ratio(AdjustLr::Original, [40, 10]), 2.0);
    assert_eq!(lr_ratio(AdjustLr::Original, [10, 40]), 1.0);
    assert!((lr_ratio(AdjustLr::MatchRmsAdamw, [10, 400]) - 4.0).abs() < 1e-12);
}

/// The iteration on a tall matrix is its transpose's, transposed; the result is close to
/// orthogonal (the quintic leaves singular values near 1, not at 1).
#[test]
fn newton_schulz_orthogonalises_either_orientation() {
    let cfg = MuonConfig::default();
    let mut state = 12345u64;
    let v: Vec<f32> = (0..24 * 8)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    let g = Tensor::from_vec(v, (24, 8), &Device::Cpu).unwrap();
    let tall = newton_schulz(&g, &cfg, DType::F32).unwrap();
    let wide = newton_schulz(&g.t().unwrap().contiguous().unwrap(), &cfg, DType::F32).unwrap();
    let d = (tall.t().unwrap() - wide)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(d, 0.0);
    // OᵀO (8 × 8) has its diagonal within the quintic's band around 1.
    let gram = tall.t().unwrap().matmul(&tall).unwrap();
    let diag: Vec<f32> = (0..8)
        .map(|i| {
            gram.get(i)
                .unwrap()
                .get(i)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .collect();
    assert!(diag.iter().all(|&x| (0.3..1.5).contains(&x)), "{diag:?}");
}

/// `[rows, cols]` standard normal values from `seed` (an LCG and Box-Muller).
fn normal_matrix([rows, cols]: [usize; 2], seed: u64) -> Tensor {
    let mut state = seed;
    let mut uniform = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| {
            let (u, w) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * w).cos()) as f32
        })
        .collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
}

/// `addmm` rounds once: in f32 it is f64's `beta c + alpha a b` within f32's sums, and in bf16
/// every element is that f32 result of the same bf16 operands rounded to bf16.
#[test]
fn addmm_rounds_once() {
    let (a, b, c) = (
        normal_matrix([24, 40], 1),
        normal_matrix([40, 16], 2),
        normal_matrix([24, 16], 3),
    );
    let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let want =
        ((f64s(&c) * -4.775).unwrap() + (f64s(&a).matmul(&f64s(&b)).unwrap() * 2.0315)).unwrap();
    let got = product::addmm(&c, &a, &b, -4.775, 2.0315).unwrap();
    let err = (f64s(&got) - &want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap();
    assert!(err.to_scalar::<f64>().unwrap() < 1e-4, "{err}");
    let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let (ab, bb, cb) = (bf(&a), bf(&b), bf(&c));
    let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let exact = product::addmm(&wide(&cb), &wide(&ab), &wide(&bb), -4.775, 2.0315).unwrap();
    let got = product::addmm(&cb, &ab, &bb, -4.775, 2.0315).unwrap();
    assert_eq!(
        got.to_vec2::<half::bf16>().unwrap(),
        bf(&exact).to_vec2::<half::bf16>().unwrap()
    );
    // Shapes that make no product are an error, not a panic.
    assert!(product::addmm(&c, &b, &a, 1.0, 1.0).is_err());
    assert!(product::addmm(&cb, &a, &b, 1.0, 1.0).is_err());
}

/// The bf16 iteration (a GPU's) stays near the f32 one, as torch's does: `torch.optim.Muon`'s
/// bf16 steps (`addmm`) differ from its f32 steps by 1.3e-2 (relative Frobenius) on 96 × 160
/// and 160 × 96 normal values; the same steps as separate bf16 operations (coefficients rounded
/// to bf16, every sum rounded) by 4.5-5.2e-2 in torch and 5.6-8.4e-2 on an H100.
#[test]
fn bf16_iteration_stays_near_f32() {
    let cfg = MuonConfig::default();
    for (shape, seed) in [([96, 160], 7), ([160, 96], 8)] {
        let g = normal_matrix(shape, seed);
        let f32s = newton_schulz(&g, &cfg, DType::F32).unwrap();
        let bf16s = newton_schulz(&g, &cfg, DType::BF16).unwrap();
        let diff = (&bf16s - &f32s).unwrap().sqr().unwrap().sum_all().unwrap();
        let norm = f32s.sqr().unwrap().sum_all().unwrap();
        let rel = (diff.to_scalar::<f32>().unwrap() / norm.to_scalar::<f32>().unwrap()).sqrt();
        eprintln!("{shape:?}: bf16 iteration vs f32 {rel:.2e}");
        assert!(rel < 2.5e-2, "{shape:?}: {rel:.2e}");
    }
}

/// The fused passes equal the chain of candle ops they replace bit for bit: the momentum, the
/// direction placed among the owned elements (with and without Nesterov, scaled and not, both
/// branches of the two-sided lerp) and the update, over runs with gaps, on values that include
/// signed zeros.
#[test]
fn fused_passes_equal_the_candle_op_chain_bit_for_bit() {
    use super::fused::{Apply, Direction, Lerp, Momentum, Run};
    let dev = Device::Cpu;
    let values = |n: usize, seed: u64| -> Vec<f32> {
        let t = normal_matrix([1, n], seed).flatten_all().unwrap();
        let mut v = t.to_vec1::<f32>().unwrap();
        for (i, x) in v.iter_mut().enumerate() {
            match i % 17 {
                0 => *x = 0.0,
                5 => *x = -0.0,
                _ => {}
            }
        }
        v
    };
    let t = |v: &[f32]| Tensor::new(v, &dev).unwrap();
    let bits = |x: &Tensor| -> Vec<u32> {
        let v = x.to_vec1::<f32>().unwrap();
        v.iter().map(|f| f.to_bits()).collect()
    };
    // 40 gradients, Muon's k = 30 elements in three runs, n = 50 owned elements.
    let runs = [
        Run {
            grad: 2,
            here: 0,
            at: 1,
            len: 10,
        },
        Run {
            grad: 15,
            here: 10,
            at: 20,
            len: 12,
        },
        Run {
            grad: 30,
            here: 22,
            at: 40,
            len: 8,
        },
    ];
    let (k, n) = (30, 50);
    for (mu, nesterov, scale) in [
        (0.95, true, None),
        (0.3, true, Some(0.37)),
        (0.6, false, Some(2.0)),
    ] {
        let (g, master, buf, o) = (values(40, 1), values(k, 2), values(k, 3), values(n, 4));
        // The candle ops.
        let gk: Vec<f32> = runs
            .iter()
            .flat_map(|r| g[r.grad..r.grad + r.len].to_vec())
            .collect();
        let mut gk = t(&gk);
        if let Some(s) = scale {
            gk = gk.affine(s as f64, 0.0).unwrap();
        }
        let want_buf = lerp(&t(&buf), &gk, 1.0 - mu).unwrap();
        let uk = if nesterov {
            lerp(&gk, &want_buf, mu).unwrap()
        } else {
            want_buf.clone()
        };
        let mut want_u = vec![0f32; n];
        let uk = uk.to_vec1::<f32>().unwrap();
        for r in &runs {
            want_u[r.at..r.at + r.len].copy_from_slice(&uk[r.here..r.here + r.len]);
        }
        let ok: Vec<f32> = runs
            .iter()
            .flat_map(|r| o[r.at..r.at + r.len].to_vec())
            .collect();
        let keep = 1.0 - 0.01 * 0.1;
        let want_master = (t(&master).affine(keep, 0.0).unwrap() + t(&ok)).unwrap();
        // The fused passes.
        let state = t(&[master.clone(), buf.clone()].concat());
        let momentum = Momentum {
            runs: &runs,
            scale,
            lerp: Lerp::new(1.0 - mu),
        };
        state.inplace_op2(&t(&g), &momentum).unwrap();
        let u = Tensor::zeros(n, DType::F32, &dev).unwrap();
        let nesterov = nesterov.then(|| Lerp::new(mu));
        let direction = Direction {
            runs: &runs,
            scale,
            nesterov,
        };
        u.inplace_op3(&t(&g), &state, &direction).unwrap();
        state
            .inplace_op2(
                &t(&o),
                &Apply {
                    runs: &runs,
                    keep: keep as f32,
                },
            )
            .unwrap();
        assert_eq!(
            bits(&state.narrow(0, k, k).unwrap()),
            bits(&want_buf),
            "momentum, mu {mu}"
        );
        assert_eq!(bits(&u), bits(&t(&want_u)), "direction, mu {mu}");
        assert_eq!(
            bits(&state.narrow(0, 0, k).unwrap()),
            bits(&want_master),
            "master, mu {mu}"
        );
    }
    // A run past its buffers is an error, not a write out of bounds.
    let state = Tensor::zeros(2 * k, DType::F32, &dev).unwrap();
    let bad = [Run {
        grad: 35,
        here: 0,
        at: 0,
        len: 10,
    }];
    let momentum = Momentum {
        runs: &bad,
        scale: None,
        lerp: Lerp::new(0.05),
    };
    assert!(state
        .inplace_op2(&Tensor::zeros(40, DType::F32, &dev).unwrap(), &momentum)
        .is_err());
}

/// Matrices of one shape iterated together equal each iterated alone, bit for bit on the CPU,
/// whatever the mix of shapes and orientations; the results come back in order.
#[test]
fn batched_newton_schulz_equals_one_matrix_at_a_time() {
    let cfg = MuonConfig::default();
    let shapes = [[6, 10], [10, 6], [6, 10], [4, 4], [10, 6], [6, 10], [3, 7]];
    let ms: Vec<Tensor> = (shapes.iter().enumerate())
        .map(|(i, &s)| normal_matrix(s, 40 + i as u64))
        .collect();
    let batched = newton_schulz_batch(&ms, &cfg, DType::F32).unwrap();
    assert_eq!(batched.len(), ms.len());
    for (i, (m, b)) in ms.iter().zip(&batched).enumerate() {
        let alone = newton_schulz(m, &cfg, DType::F32).unwrap();
        assert_eq!(b.dims(), m.dims(), "matrix {i}");
        let bits = |t: &Tensor| -> Vec<u32> {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        assert_eq!(bits(b), bits(&alone), "matrix {i} {:?}", shapes[i]);
    }
}
