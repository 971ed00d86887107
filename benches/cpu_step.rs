//! CPU training-step benchmark of the tiny recipe's model: forward alone, and a full step
//! (forward, backward, AdamW), on a fixed synthetic batch. `bench/cpu_step.sh` runs it beside the
//! PyTorch reference `bench/torch_llama.py` on the same model and batch and reports the ratio.
//!
//! Run: `cargo bench --bench cpu_step -- [recipe] [steps]`; prints one JSON line.

use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use model::{Llama, Recompute};
use parallel::comm::local::LocalWorld;
use parallel::config::{ParallelConfig, DEFAULT_BUCKET_SIZE};
use parallel::pipeline::{build, ScheduleKind};
use pretrain::optim::{layout_of, write_params, AdamW, GradBuffer};
use pretrain::recipe::load;
use pretrain::train::pipeline::{forward_losses, Executor, MicroBatch};
use pretrain::train::RankCtx;

mod common;

#[global_allocator]
static GLOBAL: pretrain::Allocator = pretrain::Allocator {};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    pretrain::process_defaults();
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let recipe_path = args
        .first()
        .map(String::as_str)
        .unwrap_or("recipes/tiny.yaml");
    let steps: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(10);
    let r = load(Path::new(recipe_path), &[])?;
    let (b, s, v) = (
        r.train.micro_batch,
        r.train.seq_len,
        r.model.vocab_size as u64,
    );
    let micro = r.grad_accum_steps();

    let batches = common::synthetic_batches(v, micro, b, s);

    let dev = Device::Cpu;
    let model = Llama::new(
        &r.model,
        model::Placement::whole(&r.model),
        r.train.seed,
        DType::F32,
        &dev,
    )?;
    let layout = layout_of(model.params(), DEFAULT_BUCKET_SIZE, 1);
    let grads = GradBuffer::new(layout.clone(), &dev)?;
    let mut opt = AdamW::new(
        model.params(),
        &layout,
        parallel::dp::owned_ranges(&layout, false, parallel::dp::ShardPos::uniform(0, 1)),
        &r.optimizer,
    )?;
    let scale = 1.0 / (micro * b * s) as f64;
    let mbs: Vec<MicroBatch> = batches
        .iter()
        .map(|bt| MicroBatch::new(bt, scale, 1.0 / micro as f64, &dev))
        .collect::<Result<_, _>>()?;
    // The training step path of one rank: a one-stage schedule through the step executor.
    let comm = LocalWorld::new(1, Duration::from_secs(60)).remove(0);
    let ctx = RankCtx::open(&ParallelConfig::default(), 0, comm, dev.clone())?;
    let schedule = build(ScheduleKind::OneFOneB, 1, 1, micro)?;
    let exec = Executor::new(&model, &ctx, &schedule, Recompute::None, b, s);

    let (mut fwd, mut step) = (vec![], vec![]);
    let mut loss = 0.0;
    for i in 0..steps + 2 {
        let t0 = Instant::now();
        for mb in &mbs {
            let inputs = (&mb.tokens, &mb.targets.labels, None);
            let losses = forward_losses(&model, &ctx, inputs, &mut ())?;
            let l = losses
                .ok_or_else(|| anyhow::anyhow!("no losses"))?
                .mean_all()?;
            std::hint::black_box(l.to_scalar::<f32>()?);
        }
        let t1 = Instant::now();
        grads.zero()?;
        loss = exec.step(&mbs, &grads, &mut (), t1)?.loss;
        opt.step(&grads, r.optimizer.lr, 1.0)?;
        write_params(model.params(), &layout, &opt.master()?)?;
        let t2 = Instant::now();
        if i >= 2 {
            fwd.push((t1 - t0).as_secs_f64() * 1e3);
            step.push((t2 - t1).as_secs_f64() * 1e3);
        }
    }
    println!(
        "{{\"impl\": \"candle\", \"threads\": {}, \"tokens_per_step\": {}, \"fwd_ms\": {:.2}, \"step_ms\": {:.2}, \"last_loss\": {:.4}}}",
        rayon::current_num_threads(),
        micro * b * s,
        median(fwd),
        median(step),
        loss
    );
    Ok(())
}
