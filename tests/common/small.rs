//! A small Llama (3 layers, hidden 32, GQA 4/2, vocabulary 96) on one CPU rank, its batches, and
//! one training step's gradients through the step executor (a one-stage schedule): for the
//! gradient tests.

use std::time::{Duration, Instant};

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use data::Batch;
use model::{Llama, LlamaConfig, Piece, Recompute, Targets};
use parallel::comm::local::LocalWorld;
use parallel::config::{ParallelConfig, DEFAULT_BUCKET_SIZE};
use parallel::pipeline::{self, ScheduleKind};
use pretrain::optim::{layout_of, GradBuffer};
use pretrain::train::pipeline::{Executor, MicroBatch};
use pretrain::train::RankCtx;

/// The small model's configuration, with tied or separate input and output embeddings.
pub fn config(tied: bool) -> LlamaConfig {
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

/// The whole model of `c` on the CPU in `dtype`, initialised with `seed`.
pub fn build(c: &LlamaConfig, dtype: DType, seed: u64) -> Llama {
    Llama::new(c, model::Placement::whole(c), seed, dtype, &Device::Cpu).unwrap()
}

/// A deterministic batch of `b` sequences of 16 tokens; the mask drops a few positions.
pub fn batch(b: usize, offset: u32) -> Batch {
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
        doc_starts: None,
    }
}

/// Tokens counted in the loss over `batches`.
pub fn counted(batches: &[Batch]) -> f64 {
    batches
        .iter()
        .flat_map(|b| b.loss_mask.iter())
        .map(|&m| m as f64)
        .sum()
}

/// One step's result on one rank.
pub struct Step {
    /// The summed scaled loss.
    pub loss: f64,
    /// Every parameter's gradient from the (f32) gradient buffer.
    pub grads: Vec<Vec<f32>>,
    /// Tensors carrying an autograd graph among what the step kept.
    pub tracked: usize,
}

/// Forward and backward over `batches` (one global batch, one micro-batch each) through the step
/// executor on one rank.
pub fn step(model: &Llama, batches: &[Batch], recompute: Recompute) -> Step {
    let layout = layout_of(model.params(), DEFAULT_BUCKET_SIZE, 1);
    let buf = GradBuffer::new(layout, &Device::Cpu).unwrap();
    let comm = LocalWorld::new(1, Duration::from_secs(10)).remove(0);
    let ctx = RankCtx::open(&ParallelConfig::default(), 0, comm, Device::Cpu).unwrap();
    let schedule = pipeline::build(ScheduleKind::OneFOneB, 1, 1, batches.len()).unwrap();
    let (b, s) = (batches[0].micro_batch, batches[0].seq_len);
    let exec = Executor::new(model, &ctx, &schedule, recompute, b, s);
    let scale = 1.0 / counted(batches);
    let mbs: Vec<MicroBatch> = batches
        .iter()
        .map(|b| MicroBatch::new(b, scale, 1.0 / batches.len() as f64, &Device::Cpu).unwrap())
        .collect();
    let run = exec.step(&mbs, &buf, &mut (), Instant::now()).unwrap();
    let grads = (0..model.params().len())
        .map(|i| buf.get(i).unwrap().to_vec1::<f32>().unwrap())
        .collect();
    Step {
        loss: run.loss,
        grads,
        tracked: run.tracked,
    }
}

/// The largest difference of two gradient lists, relative to each tensor's largest element.
pub fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
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

/// Every piece's forward in order, then every backward in reverse, straight through the model's
/// functions (no gradient buffer): the loss and each parameter's gradient summed over the pieces,
/// in the model's dtype.
pub fn pieces(model: &Llama, tokens: &Tensor, targets: &Targets) -> (f64, Vec<Tensor>) {
    let c = model.config();
    let pieces: Vec<Piece> = std::iter::once(Piece::Embedding)
        .chain((0..c.num_hidden_layers).map(Piece::Block))
        .chain([Piece::Head])
        .collect();
    let (mut x, mut tapes) = (tokens.clone(), Vec::new());
    for &p in &pieces {
        let f = model.forward(p, &x, targets).unwrap();
        let kept = f.tape.tensors();
        assert_eq!(model::segment::tracked(&kept), 0, "{p:?} kept a graph");
        x = f.y;
        tapes.push(f.tape);
    }
    let loss = x.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
    let mut sums: HashMap<usize, Tensor> = HashMap::new();
    let mut dy = None;
    for tape in tapes.into_iter().rev() {
        let g = model.backward(tape, dy.as_ref()).unwrap();
        for (i, pg) in g.params {
            let t = pg.into_tensor().unwrap();
            let sum = match sums.remove(&i) {
                Some(s) => (s + t).unwrap(),
                None => t,
            };
            sums.insert(i, sum);
        }
        dy = g.dx;
    }
    let grads = model
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| match sums.remove(&i) {
            Some(g) => g,
            None => p.tensor().unwrap().zeros_like().unwrap(),
        })
        .collect();
    (loss, grads)
}
