//! Gradients through the step executor: every parameter receives one, activation recompute
//! changes nothing, and accumulation over micro-batches equals one large batch. (The gradients'
//! values against autograd: `tests/hand_written_backward.rs`.)

use candle_core::{DType, Device};
use data::Batch;
use model::{Llama, Recompute};

mod common;
use common::small::{self, batch, config, max_rel_diff};

/// The small model on the CPU in f32, initialised with `seed`.
fn build(tied: bool, seed: u64) -> Llama {
    small::build(&config(tied), DType::F32, seed)
}

/// Forward and backward over `batches` on one rank: (loss, gradients).
fn grads_of(model: &Llama, batches: &[Batch], recompute: Recompute) -> (f64, Vec<Vec<f32>>) {
    let s = small::step(model, batches, recompute);
    assert_eq!(s.tracked, 0, "the step built an autograd graph");
    (s.loss, s.grads)
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    for tied in [true, false] {
        let model = build(tied, 3);
        let (loss, grads) = grads_of(&model, &[batch(2, 0)], Recompute::None);
        assert!(
            (loss - (96f64).ln()).abs() < 0.1,
            "initial loss {loss} should be near ln(vocab)"
        );
        for (p, g) in model.params().iter().zip(&grads) {
            let norm: f64 = g.iter().map(|v| (*v as f64).powi(2)).sum();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{} (tied={tied}) has gradient norm² {norm}",
                p.name
            );
        }
        let expected = 1 + 9 * 3 + 1 + usize::from(!tied);
        assert_eq!(model.params().len(), expected);
    }
}

#[test]
fn full_recompute_gives_identical_gradients() {
    let model = build(false, 5);
    let batches = [batch(2, 0), batch(2, 100)];
    let (l0, g0) = grads_of(&model, &batches, Recompute::None);
    let (l1, g1) = grads_of(&model, &batches, Recompute::Full);
    assert_eq!(l0, l1);
    assert_eq!(
        g0, g1,
        "recompute re-runs the same kernels: gradients must be bit-identical"
    );
}

#[test]
fn accumulating_micro_batches_equals_one_large_batch() {
    let model = build(false, 9);
    let big = batch(4, 0);
    let halves: Vec<Batch> = (0..2)
        .map(|h| {
            let n = 2 * 16;
            Batch {
                tokens: big.tokens[h * n..(h + 1) * n].to_vec(),
                labels: big.labels[h * n..(h + 1) * n].to_vec(),
                loss_mask: big.loss_mask[h * n..(h + 1) * n].to_vec(),
                micro_batch: 2,
                seq_len: 16,
                doc_starts: None,
            }
        })
        .collect();
    let (l1, g1) = grads_of(&model, std::slice::from_ref(&big), Recompute::None);
    let (l2, g2) = grads_of(&model, &halves, Recompute::None);
    assert!((l1 - l2).abs() < 1e-6, "{l1} vs {l2}");
    // Same maths, different f32 summation grouping: 1e-5 relative.
    let d = max_rel_diff(&g1, &g2);
    assert!(
        d < 1e-5,
        "accumulated vs single-batch gradients differ by {d}"
    );
}

#[test]
fn initialisation_is_bit_identical_for_equal_seeds() {
    let a = build(false, 11);
    let b = build(false, 11);
    let c = build(false, 12);
    for ((pa, pb), pc) in a
        .params()
        .iter()
        .zip(b.params().iter())
        .zip(c.params().iter())
    {
        let va = pa
            .tensor()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(
            va,
            pb.tensor()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            "{}",
            pa.name
        );
        if !pa.name.contains("norm") {
            assert_ne!(
                va,
                pc.tensor()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
                "{}",
                pa.name
            );
        }
    }
}

#[test]
fn tensor_shapes_list_exactly_the_model_parameters() {
    for tied in [true, false] {
        let c = config(tied);
        let model =
            Llama::new(&c, model::Placement::whole(&c), 1, DType::F32, &Device::Cpu).unwrap();
        let built: Vec<(String, Vec<usize>)> = model
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.global_shape.clone()))
            .collect();
        assert_eq!(built, c.tensor_shapes());
    }
}
