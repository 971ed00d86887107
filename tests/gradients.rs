//! Gradients through the segmented model: every parameter receives one, activation recompute
//! changes nothing, segments equal one whole-graph backward, and accumulation over micro-batches
//! equals one large batch.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use data::Batch;
use model::{Llama, LlamaConfig, Recompute};
use parallel::comm::local::LocalWorld;
use parallel::config::{ParallelConfig, DEFAULT_BUCKET_SIZE};
use parallel::pipeline::{self, ScheduleKind};
use pretrain::optim::{layout_of, GradBuffer};
use pretrain::train::pipeline::{Executor, MicroBatch};
use pretrain::train::RankCtx;

fn config(tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 96,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 3,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: tied,
        max_position_embeddings: 32,
        init_std: 0.02,
        head_dim: None,
        rope_scaling: None,
        bos_token_id: None,
        eos_token_id: None,
        ..Default::default()
    }
}

/// The whole model of `config(tied)` on the CPU in f32, initialised with `seed`.
fn build(tied: bool, seed: u64) -> Llama {
    let c = config(tied);
    Llama::new(
        &c,
        model::Placement::whole(&c),
        seed,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
}

/// A deterministic batch of `b` sequences of 16 tokens; the mask drops a few positions.
fn batch(b: usize, offset: u32) -> Batch {
    let s = 16;
    let seq: Vec<u32> = (0..b * (s + 1))
        .map(|i| ((i as u32 + offset).wrapping_mul(2654435761) >> 7) % 96)
        .collect();
    let mut tokens = Vec::new();
    let mut labels = Vec::new();
    for r in 0..b {
        tokens.extend_from_slice(&seq[r * (s + 1)..r * (s + 1) + s]);
        labels.extend_from_slice(&seq[r * (s + 1) + 1..(r + 1) * (s + 1)]);
    }
    let loss_mask = (0..b * s)
        .map(|i| if i % 7 == 3 { 0.0 } else { 1.0 })
        .collect();
    Batch {
        tokens,
        labels,
        loss_mask,
        micro_batch: b,
        seq_len: s,
    }
}

fn counted(batches: &[Batch]) -> f64 {
    batches
        .iter()
        .flat_map(|b| b.loss_mask.iter())
        .map(|&m| m as f64)
        .sum()
}

/// Runs forward/backward over `batches` (one global batch) through the step executor on one rank
/// (a one-stage schedule) and returns (loss, grads per param).
fn grads_of(model: &Llama, batches: &[Batch], recompute: Recompute) -> (f64, Vec<Vec<f32>>) {
    let layout = layout_of(model.params(), DEFAULT_BUCKET_SIZE, 1);
    let buf = GradBuffer::new(layout, &Device::Cpu).unwrap();
    let comm = LocalWorld::new(1, Duration::from_secs(10)).remove(0);
    let ctx = RankCtx::new(&ParallelConfig::default(), 0, comm).unwrap();
    let schedule = pipeline::build(ScheduleKind::OneFOneB, 1, 1, batches.len()).unwrap();
    let (b, s) = (batches[0].micro_batch, batches[0].seq_len);
    let exec = Executor::new(model, &ctx, &schedule, recompute, b, s);
    let scale = 1.0 / counted(batches);
    let mbs: Vec<MicroBatch> = batches
        .iter()
        .map(|b| MicroBatch::new(b, scale, 1.0 / batches.len() as f64, &Device::Cpu).unwrap())
        .collect();
    let loss = exec.step(&mbs, &buf, &mut (), Instant::now()).unwrap().loss;
    let g = (0..model.params().len())
        .map(|i| buf.get(i).unwrap().to_vec1::<f32>().unwrap())
        .collect();
    (loss, g)
}

fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let mut worst = 0.0f64;
    for (x, y) in a.iter().zip(b) {
        let scale = x
            .iter()
            .map(|v| v.abs() as f64)
            .fold(0.0, f64::max)
            .max(1e-12);
        for (u, v) in x.iter().zip(y) {
            worst = worst.max((*u as f64 - *v as f64).abs() / scale);
        }
    }
    worst
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
fn segments_equal_one_whole_graph_backward() {
    let model = build(true, 7);
    let b = batch(2, 0);
    let (loss, seg) = grads_of(&model, std::slice::from_ref(&b), Recompute::None);

    let tokens = Tensor::from_slice(&b.tokens, (2, 16), &Device::Cpu).unwrap();
    let labels = Tensor::from_slice(&b.labels, 32, &Device::Cpu).unwrap();
    let mask = Tensor::from_slice(&b.loss_mask, 32, &Device::Cpu).unwrap();
    let whole = ((model.token_losses(&tokens, &labels).unwrap() * &mask)
        .unwrap()
        .sum_all()
        .unwrap()
        / counted(std::slice::from_ref(&b)))
    .unwrap();
    let store = whole.backward().unwrap();
    let full: Vec<Vec<f32>> = model
        .params()
        .iter()
        .map(|p| {
            store
                .get(&p.tensor().unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect();
    assert!((whole.to_scalar::<f32>().unwrap() as f64 - loss).abs() < 1e-6);
    // f32 with a different summation order for the tied embedding's two contributions: 1e-5 relative
    // to each tensor's largest gradient is far below any real error (which shows up at O(1)).
    let d = max_rel_diff(&seg, &full);
    assert!(d < 1e-5, "segmented vs whole-graph gradients differ by {d}");
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
