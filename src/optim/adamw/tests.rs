//! Tests of AdamW: PyTorch's update in f64 with a decay mask and gradient scale, bf16 moments
//! against a reference that rounds them, and the state's round trips and conversions.

use super::*;
use candle_core::Device;
use model::init::Init;
use parallel::tp::TensorParallel;

use crate::recipe::StateDtype;

fn cfg() -> OptimizerConfig {
    OptimizerConfig {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.5,
        decay_embeddings: false,
        state_dtype: StateDtype::Fp32,
        name: Default::default(),
        muon: Default::default(),
        offload: Default::default(),
        offload_threads: 0,
    }
}

/// PyTorch's AdamW in f64 for one tensor.
fn reference(
    p: &mut [f64],
    m: &mut [f64],
    v: &mut [f64],
    g: &[f64],
    c: &OptimizerConfig,
    wd: f64,
    t: i32,
) {
    for i in 0..p.len() {
        p[i] *= 1.0 - c.lr * wd;
        m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g[i];
        v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * g[i] * g[i];
        let mh = m[i] / (1.0 - c.beta1.powi(t));
        let vh = v[i] / (1.0 - c.beta2.powi(t));
        p[i] -= c.lr * mh / (vh.sqrt() + c.eps);
    }
}

#[test]
fn matches_reference_adamw_with_decay_mask_and_grad_scale() {
    let dev = Device::Cpu;
    let mut ps = ParamSet::default();
    ps.add(
        model::ParamSpec {
            name: "w",
            global_shape: &[2, 3],
            kind: ParamKind::Matrix,
            init: Init::Normal { std: 1.0 },
        },
        1,
        &TensorParallel::single(),
        DType::F32,
        &dev,
    )
    .unwrap();
    ps.add(
        model::ParamSpec {
            name: "norm",
            global_shape: &[3],
            kind: ParamKind::Norm,
            init: Init::Constant(1.0),
        },
        1,
        &TensorParallel::single(),
        DType::F32,
        &dev,
    )
    .unwrap();
    let c = cfg();
    let layout = crate::optim::layout_of(&ps, parallel::config::DEFAULT_BUCKET_SIZE, 1);
    let mut opt = AdamW::new(
        &ps,
        &layout,
        parallel::dp::owned_ranges(&layout, false, parallel::dp::ShardPos::uniform(0, 1)),
        &c,
    )
    .unwrap();
    let grads = GradBuffer::new(layout.clone(), &dev).unwrap();

    let mut p: Vec<Vec<f64>> = ps
        .iter()
        .map(|q| {
            q.tensor()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|&x| x as f64)
                .collect()
        })
        .collect();
    let mut m = vec![vec![0.0; 6], vec![0.0; 3]];
    let mut v = m.clone();
    for t in 1..=3 {
        let g: Vec<Vec<f64>> = vec![
            (0..6).map(|i| (i as f64 - 2.5) * 0.1 * t as f64).collect(),
            (0..3).map(|i| 0.3 - i as f64 * 0.2).collect(),
        ];
        grads.zero().unwrap();
        for (i, gi) in g.iter().enumerate() {
            let gt = Tensor::from_vec(
                gi.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                gi.len(),
                &dev,
            )
            .unwrap();
            grads.accumulate(i, &gt).unwrap();
        }
        let scale = 0.5;
        opt.step(&grads, c.lr, scale).unwrap();
        crate::optim::write_params(&ps, &layout, &opt.master().unwrap()).unwrap();
        for (i, wd) in [(0, c.weight_decay), (1, 0.0)] {
            let gs: Vec<f64> = g[i].iter().map(|x| x * scale).collect();
            reference(&mut p[i], &mut m[i], &mut v[i], &gs, &c, wd, t);
            let got = ps
                .get(i)
                .tensor()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            for (a, b) in got.iter().zip(&p[i]) {
                assert!(
                    (*a as f64 - b).abs() < 1e-5,
                    "param {i} step {t}: {a} vs {b}"
                );
            }
        }
    }
    let st = opt.state().unwrap();
    assert_eq!((st.step, st.master.len(), st.exp_avg.len()), (3, 9, 9));
}

#[test]
fn state_round_trips() {
    let dev = Device::Cpu;
    let mut ps = ParamSet::default();
    ps.add(
        model::ParamSpec {
            name: "w",
            global_shape: &[4],
            kind: ParamKind::Matrix,
            init: Init::Normal { std: 1.0 },
        },
        2,
        &TensorParallel::single(),
        DType::F32,
        &dev,
    )
    .unwrap();
    let layout = crate::optim::layout_of(&ps, parallel::config::DEFAULT_BUCKET_SIZE, 1);
    let mut a = AdamW::new(
        &ps,
        &layout,
        parallel::dp::owned_ranges(&layout, false, parallel::dp::ShardPos::uniform(0, 1)),
        &cfg(),
    )
    .unwrap();
    let g = GradBuffer::new(layout.clone(), &dev).unwrap();
    g.accumulate(0, &Tensor::new(&[1f32, -2.0, 3.0, 0.5], &dev).unwrap())
        .unwrap();
    a.step(&g, 0.1, 1.0).unwrap();
    let mut b = AdamW::new(
        &ps,
        &layout,
        parallel::dp::owned_ranges(&layout, false, parallel::dp::ShardPos::uniform(0, 1)),
        &cfg(),
    )
    .unwrap();
    b.load_state(&a.state().unwrap()).unwrap();
    let (sa, sb) = (a.state().unwrap(), b.state().unwrap());
    assert_eq!(sa, sb);
    let bad = AdamWState {
        step: 1,
        master: vec![0.0; 5],
        ..sa
    };
    let e = b.load_state(&bad).unwrap_err().to_string();
    assert!(
        e.contains(
            "optimizer state has [5, 4, 4] master weights and moments, this rank needs 4 of each"
        ),
        "{e}"
    );
}

/// A matrix `w` of `n` elements, and AdamW over all of it with moments in `dtype`.
fn matrix(n: usize, dtype: StateDtype) -> (ParamSet, FlatLayout, AdamW) {
    let mut ps = ParamSet::default();
    let shape = [n];
    let spec = model::ParamSpec {
        name: "w",
        global_shape: &shape,
        kind: ParamKind::Matrix,
        init: Init::Normal { std: 1.0 },
    };
    let tp = TensorParallel::single();
    ps.add(spec, 3, &tp, DType::F32, &Device::Cpu).unwrap();
    let layout = crate::optim::layout_of(&ps, parallel::config::DEFAULT_BUCKET_SIZE, 1);
    let owned = parallel::dp::owned_ranges(&layout, false, parallel::dp::ShardPos::uniform(0, 1));
    let c = OptimizerConfig {
        state_dtype: dtype,
        ..cfg()
    };
    let opt = AdamW::new(&ps, &layout, owned, &c).unwrap();
    (ps, layout, opt)
}

/// bf16 moments: the update is computed in f32 from the stored (rounded) moments and the
/// moments are stored rounded to nearest — an f64 AdamW that rounds its moments to bf16
/// after each step agrees to f32 precision; the state takes 8 bytes per element, not 12.
#[test]
fn bf16_moments_follow_a_reference_that_rounds_them() {
    let n = 64;
    let (ps, layout, mut opt) = matrix(n, StateDtype::Bf16);
    let (_, _, full) = matrix(n, StateDtype::Fp32);
    assert_eq!((opt.state_bytes(), full.state_bytes()), (8 * n, 12 * n));
    let c = cfg();
    let grads = GradBuffer::new(layout.clone(), &Device::Cpu).unwrap();
    let round = |x: f64| bf16::from_f32(x as f32).to_f64();
    let mut p: Vec<f64> = ps
        .get(0)
        .tensor()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|&x| x as f64)
        .collect();
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    for t in 1..=4 {
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 7 + t * 3) % 11) as f32 * 0.1 - 0.5)
            .collect();
        grads.zero().unwrap();
        grads
            .accumulate(0, &Tensor::new(g.as_slice(), &Device::Cpu).unwrap())
            .unwrap();
        opt.step(&grads, c.lr, 1.0).unwrap();
        for i in 0..n {
            let gi = g[i] as f64;
            p[i] *= 1.0 - c.lr * c.weight_decay;
            let mi = c.beta1 * m[i] + (1.0 - c.beta1) * gi;
            let vi = c.beta2 * v[i] + (1.0 - c.beta2) * gi * gi;
            let mh = mi / (1.0 - c.beta1.powi(t as i32));
            let vh = vi / (1.0 - c.beta2.powi(t as i32));
            p[i] -= c.lr * mh / (vh.sqrt() + c.eps);
            (m[i], v[i]) = (round(mi), round(vi));
        }
    }
    let st = opt.state().unwrap();
    assert_eq!(st.exp_avg.dtype(), PieceDtype::Bf16);
    for (a, b) in st.master.iter().zip(&p) {
        assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
    }
    for (got, want) in [(&st.exp_avg, &m), (&st.exp_avg_sq, &v)] {
        let got = got.to_f32();
        let off = got
            .iter()
            .zip(want.iter())
            .filter(|(a, b)| **a as f64 != **b)
            .count();
        assert!(
            off <= n / 16,
            "{off} of {n} moments differ from the rounded reference"
        );
    }
    assert!(opt.state_sum_squares().unwrap().is_finite());
}

/// A bf16 state round-trips exactly; a state resumes under the other moment dtype by
/// conversion (f32 to bf16 rounds to nearest, bf16 to f32 is exact).
#[test]
fn states_round_trip_and_convert_between_moment_dtypes() {
    let n = 10;
    let (_, layout, mut a) = matrix(n, StateDtype::Bf16);
    let g = GradBuffer::new(layout, &Device::Cpu).unwrap();
    let gs: Vec<f32> = (0..n).map(|i| i as f32 * 0.37 - 1.3).collect();
    g.accumulate(0, &Tensor::new(gs.as_slice(), &Device::Cpu).unwrap())
        .unwrap();
    a.step(&g, 0.1, 1.0).unwrap();
    a.step(&g, 0.1, 1.0).unwrap();
    let sa = a.state().unwrap();
    let (_, _, mut b) = matrix(n, StateDtype::Bf16);
    b.load_state(&sa).unwrap();
    assert_eq!(b.state().unwrap(), sa);

    // bf16 into fp32: exact; and back: exact again.
    let (_, _, mut f) = matrix(n, StateDtype::Fp32);
    f.load_state(&sa).unwrap();
    let sf = f.state().unwrap();
    assert_eq!(sf.exp_avg, Values::F32(sa.exp_avg.to_f32()));
    b.load_state(&sf).unwrap();
    assert_eq!(b.state().unwrap(), sa);

    // fp32 into bf16: rounded to nearest.
    let (_, layout, mut f) = matrix(n, StateDtype::Fp32);
    let g = GradBuffer::new(layout, &Device::Cpu).unwrap();
    g.accumulate(0, &Tensor::new(gs.as_slice(), &Device::Cpu).unwrap())
        .unwrap();
    f.step(&g, 0.1, 1.0).unwrap();
    let sf = f.state().unwrap();
    b.load_state(&sf).unwrap();
    let sb = b.state().unwrap();
    assert_eq!((sb.step, &sb.master), (1, &sf.master));
    assert_eq!(sb.exp_avg_sq, sf.exp_avg_sq.to_dtype(PieceDtype::Bf16));
    assert_ne!(
        sb.exp_avg_sq.to_f32(),
        sf.exp_avg_sq.to_f32(),
        "nothing was rounded"
    );
}

/// The update applied a part at a time, the parts in any order (the offloaded update's way),
/// equals the whole update bit for bit, with fp32 and with bf16 moments (odd part edges split
/// the bf16 moments' words).
#[test]
fn an_update_by_parts_equals_the_whole_update_bit_for_bit() {
    let n = 37;
    for dtype in [StateDtype::Fp32, StateDtype::Bf16] {
        let (_, layout, mut whole) = matrix(n, dtype);
        let (_, _, mut parts) = matrix(n, dtype);
        let grads = GradBuffer::new(layout.clone(), &Device::Cpu).unwrap();
        for step in 0..3 {
            let g: Vec<f32> = (0..n).map(|i| ((i * 7 + step) % 11) as f32 - 5.0).collect();
            grads
                .flat()
                .slice_set(&Tensor::new(g.as_slice(), &Device::Cpu).unwrap(), 0, 0)
                .unwrap();
            whole.step(&grads, 0.01, 0.5).unwrap();
            let op = parts.begin(0.01, 0.5).unwrap();
            for r in [20..37, 0..7, 7..20] {
                let part = Tensor::new(&g[r.clone()], &Device::Cpu).unwrap();
                parts.apply_part(&op, r.start, &part).unwrap();
            }
            assert_eq!(whole.state().unwrap(), parts.state().unwrap(), "{dtype:?}");
        }
        // A part past the owned elements is an error, not a write out of bounds.
        let op = parts.begin(0.01, 1.0).unwrap();
        let part = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
        assert!(parts.apply_part(&op, 30, &part).is_err());
    }
}

/// The update flags what it stores: a finite step leaves the flag clear; a gradient that
/// overflows the second moment sets it, whole or a part at a time (the offloaded update), in
/// both moment dtypes, and reading the flag clears it. The flag agrees with a sum over the state.
#[test]
fn an_update_that_stores_a_non_finite_value_is_flagged_once() {
    for dtype in [StateDtype::Fp32, StateDtype::Bf16] {
        let n = 10;
        let (_, layout, mut a) = matrix(n, dtype);
        let g = GradBuffer::new(layout, &Device::Cpu).unwrap();
        let finite: Vec<f32> = (0..n).map(|i| i as f32 * 0.1 - 0.4).collect();
        g.accumulate(0, &Tensor::new(finite.as_slice(), &Device::Cpu).unwrap())
            .unwrap();
        a.step(&g, 0.1, 1.0).unwrap();
        assert!(!a.take_nonfinite().unwrap(), "{dtype:?}");
        assert!(a.state_sum_squares().unwrap().is_finite());

        // 3e30² overflows f32: an infinite second moment, a NaN master weight.
        let mut huge = finite.clone();
        huge[7] = 3e30;
        let grad = Tensor::new(huge.as_slice(), &Device::Cpu).unwrap();
        let op = a.begin(0.1, 1.0).unwrap();
        a.apply_part(&op, 0, &grad.narrow(0, 0, 5).unwrap())
            .unwrap();
        assert!(
            !a.take_nonfinite().unwrap(),
            "{dtype:?}: the first part is finite"
        );
        a.apply_part(&op, 5, &grad.narrow(0, 5, 5).unwrap())
            .unwrap();
        assert!(
            a.take_nonfinite().unwrap(),
            "{dtype:?}: the second part is not"
        );
        assert!(
            !a.take_nonfinite().unwrap(),
            "{dtype:?}: reading clears the flag"
        );
        assert!(!a.state_sum_squares().unwrap().is_finite());
    }
}

/// The update writing the parameters: the same state as `step`, and the new masters in the
/// parameters rounded to their dtype (bf16 nearest even, f32 as they are); parameters of
/// another length are refused before anything is updated.
#[test]
fn an_update_into_the_parameters_writes_the_new_masters_in_their_dtype() {
    let n = 29;
    for dtype in [DType::F32, DType::BF16] {
        let (_, layout, mut plain) = matrix(n, StateDtype::Fp32);
        let (_, _, mut into) = matrix(n, StateDtype::Fp32);
        let grads = GradBuffer::new(layout, &Device::Cpu).unwrap();
        let g: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.3 - 1.0).collect();
        grads
            .accumulate(0, &Tensor::new(g.as_slice(), &Device::Cpu).unwrap())
            .unwrap();
        let params = Tensor::zeros(n, dtype, &Device::Cpu).unwrap();
        let short = Tensor::zeros(n - 1, dtype, &Device::Cpu).unwrap();
        assert!(into.step_into(&grads, (0.01, 0.5), &short).is_err());
        plain.step(&grads, 0.01, 0.5).unwrap();
        into.step_into(&grads, (0.01, 0.5), &params).unwrap();
        assert_eq!(plain.state().unwrap(), into.state().unwrap(), "{dtype:?}");
        let want: Vec<f32> = plain.master().unwrap().to_vec1().unwrap();
        let got: Vec<f32> = params.to_dtype(DType::F32).unwrap().to_vec1().unwrap();
        for (w, x) in want.iter().zip(&got) {
            let w = match dtype {
                DType::BF16 => bf16::from_f32(*w).to_f32(),
                _ => *w,
            };
            assert_eq!(w.to_bits(), x.to_bits(), "{dtype:?}");
        }
    }
}
