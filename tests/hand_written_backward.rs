//! The pieces' hand-written backward passes against candle's autograd over the reference model
//! (`common::reference`: the same ops composed without any of the model's code), and the
//! training step's promise that no piece builds an autograd graph.
//!
//! Tolerances: in f64 the two sides differ only in the order of some sums (a MoE token's slots,
//! the router's closed-form gradients), so the gradients agree to about 1e-15 of their largest
//! element (measured: dense bit for bit, MoE 6.2e-16); asserted 1e-11. The loss is compared at
//! f32 precision (the head reports it in f32). Through the training step in f32 the gradients
//! also pass the f32 gradient buffer and, over two micro-batches, its accumulation (measured:
//! untied 0, tied 7.3e-8, MoE 4.6e-7 of each tensor's largest element); asserted 1e-5. A 1e-6
//! relative error planted in the head's loss gradient fails the f64 comparison (1.0e-6).

use candle_core::{DType, Device, Tensor};
use model::{LlamaConfig, Recompute, Targets};

mod common;
use common::reference::loss_and_grads as reference;
use common::small::{self, batch, config, counted, max_rel_diff};
use common::{run, MOE};

/// The small model as a mixture of experts: 4 experts of width 24, top-2, both router losses
/// on, the first layer dense.
fn moe_config() -> LlamaConfig {
    let mut c = config(false);
    c.num_local_experts = Some(4);
    c.num_experts_per_tok = Some(2);
    c.moe_intermediate_size = Some(24);
    c.router_aux_loss_coef = Some(0.02);
    c.router_z_loss_coef = Some(0.001);
    c.mlp_only_layers = vec![0];
    c
}

/// The configurations compared: dense with tied and with separate embeddings, and MoE.
fn configs() -> [(&'static str, LlamaConfig); 3] {
    [
        ("tied", config(true)),
        ("untied", config(false)),
        ("moe", moe_config()),
    ]
}

/// A batch's tensors on the CPU with the loss scale of `counted` tokens and the router losses'
/// scale `aux_scale`.
fn targets(b: &data::Batch, counted: f64, aux_scale: f64) -> (Tensor, Targets) {
    let dev = Device::Cpu;
    let n = b.micro_batch * b.seq_len;
    let tokens = Tensor::from_slice(&b.tokens, (b.micro_batch, b.seq_len), &dev).unwrap();
    let targets = Targets {
        labels: Tensor::from_slice(&b.labels, n, &dev).unwrap(),
        loss_mask: Tensor::from_slice(&b.loss_mask, n, &dev).unwrap(),
        loss_scale: 1.0 / counted,
        aux_scale,
        documents: None,
    };
    (tokens, targets)
}

fn to_f32(ts: &[Tensor]) -> Vec<Vec<f32>> {
    ts.iter()
        .map(|t| {
            t.flatten_all()
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1()
                .unwrap()
        })
        .collect()
}

/// The largest difference of two f64 gradient lists, relative to each reference tensor's
/// largest element.
fn max_rel_diff_f64(got: &[Tensor], want: &[Tensor]) -> f64 {
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let mut worst = 0f64;
    for (g, w) in got.iter().zip(want) {
        let (g, w) = (flat(g), flat(w));
        let scale = w.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-300);
        for (a, b) in g.iter().zip(&w) {
            worst = worst.max((a - b).abs() / scale);
        }
    }
    worst
}

#[test]
fn every_piece_equals_autograd_over_the_reference_in_f64() {
    for (name, c) in configs() {
        let model = small::build(&c, DType::F64, 3);
        let b = batch(2, 5);
        let (tokens, t) = targets(&b, counted(std::slice::from_ref(&b)), 1.0);
        let (loss, got) = small::pieces(&model, &tokens, &t);
        let (want_loss, want) = reference(&model, &tokens, &t).unwrap();
        // The head reports the loss in f32.
        assert!(
            (loss - want_loss).abs() < 1e-6 * want_loss,
            "{name}: loss {loss} vs {want_loss}"
        );
        let d = max_rel_diff_f64(&got, &want);
        eprintln!("{name}: gradients differ by {d:.2e} of their largest element");
        assert!(d < 1e-11, "{name}: gradients differ by {d:.2e}");
        for (p, g) in model.params().iter().zip(&want) {
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert!(norm > 0.0, "{name}: {} has no reference gradient", p.name);
        }
    }
}

/// The training step in f32 over two micro-batches (the gradient buffer's accumulation, the
/// fused weight-gradient products), with and without recompute, against the reference's
/// gradients of the two micro-batches summed.
#[test]
fn the_training_step_equals_autograd_in_f32() {
    for (name, c) in configs() {
        let model = small::build(&c, DType::F32, 4);
        let batches = [batch(2, 0), batch(2, 100)];
        let total = counted(&batches);
        let mut want: Option<Vec<Tensor>> = None;
        let mut want_loss = 0.0;
        for b in &batches {
            let (tokens, t) = targets(b, total, 0.5);
            let (l, g) = reference(&model, &tokens, &t).unwrap();
            want_loss += l;
            want = Some(match want {
                Some(w) => w.iter().zip(&g).map(|(a, b)| (a + b).unwrap()).collect(),
                None => g,
            });
        }
        let want = to_f32(&want.unwrap());
        for recompute in [Recompute::None, Recompute::Full] {
            let s = small::step(&model, &batches, recompute);
            assert_eq!(s.tracked, 0, "{name}: the step built an autograd graph");
            let d = max_rel_diff(&want, &s.grads);
            eprintln!("{name} {recompute:?}: gradients differ by {d:.2e}");
            assert!(
                d < 1e-5,
                "{name} {recompute:?}: gradients differ by {d:.2e}"
            );
            assert!((s.loss - want_loss).abs() < 1e-6 * want_loss, "{name}");
        }
    }
}

/// No layout's training step builds an autograd graph: every tensor its pieces keep, hand on
/// and return carries none (`StepMemory::graph_tensors`).
#[test]
fn no_step_builds_an_autograd_graph() {
    for layout in [
        "parallel.dp=1",
        "parallel.tp=2,parallel.sequence_parallel=true,train.recompute=full",
        "parallel.cp=2",
        "parallel.pp=2,parallel.virtual_stages=2,parallel.dp=2,parallel.zero=3",
        &format!("{MOE},parallel.dp=2,parallel.ep=2"),
        &format!("{MOE},parallel.tp=2,parallel.sequence_parallel=true"),
    ] {
        let out = run(layout);
        for r in &out.records {
            assert_eq!(r.memory.graph_tensors, 0, "{layout}: step {}", r.step);
        }
    }
}
