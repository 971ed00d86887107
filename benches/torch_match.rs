//! Our training steps beside PyTorch's from the same weights: the recipe's model (f32, CPU,
//! seeded initialisation) trained for STEPS steps on the benches' synthetic token
//! stream at a constant learning rate, without clipping, with the recipe's optimizer (AdamW, or
//! Muon for the hidden matrices). Writes the initial weights to OUT (safetensors, Hugging Face
//! names) and prints `{"losses": [...]}`; `bench/torch_match.sh` trains the same weights with
//! `torch.optim` (`bench/torch_match.py`) and compares the curves.
//!
//! Run: `cargo bench --bench torch_match -- RECIPE STEPS OUT [key=value,...]`.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use candle_core::{DType, Device};
use model::{Llama, Recompute};
use parallel::comm::local::LocalWorld;
use parallel::config::{ParallelConfig, DEFAULT_BUCKET_SIZE};
use parallel::pipeline::{build, ScheduleKind};
use pretrain::optim::{layout_of, write_params, GradBuffer, Optimizer};
use pretrain::recipe::load;
use pretrain::train::pipeline::{Executor, MicroBatch};
use pretrain::train::RankCtx;

mod common;

#[global_allocator]
static GLOBAL: pretrain::Allocator = pretrain::Allocator {};

fn main() -> anyhow::Result<()> {
    pretrain::process_defaults();
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let [recipe, steps, out, rest @ ..] = args.as_slice() else {
        anyhow::bail!("usage: torch_match RECIPE STEPS OUT [key=value,...]");
    };
    let steps: usize = steps.parse()?;
    let r = load(Path::new(recipe), rest)?;
    let (b, s, v) = (
        r.train.micro_batch,
        r.train.seq_len,
        r.model.vocab_size as u64,
    );
    let micro = r.grad_accum_steps();
    let batches = common::synthetic_batches(v, micro, b, s);

    let dev = Device::Cpu;
    let whole = model::Placement::whole(&r.model);
    let model = Llama::new(&r.model, whole, r.train.seed, DType::F32, &dev)?;
    let initial: HashMap<String, candle_core::Tensor> = model
        .params()
        .iter()
        .map(|p| Ok((p.name.clone(), p.tensor()?)))
        .collect::<candle_core::Result<_>>()?;
    candle_core::safetensors::save(&initial, out)?;

    let layout = layout_of(model.params(), DEFAULT_BUCKET_SIZE, 1);
    let grads = GradBuffer::new(layout.clone(), &dev)?;
    let hidden = model.inventory().hidden_matrices();
    let mut opt = Optimizer::single_rank(model.params(), &layout, &r.optimizer, &hidden)?;
    let scale = 1.0 / (micro * b * s) as f64;
    let mbs: Vec<MicroBatch> = batches
        .iter()
        .map(|bt| MicroBatch::new(bt, scale, 1.0 / micro as f64, &dev))
        .collect::<Result<_, _>>()?;
    let comm = LocalWorld::new(1, Duration::from_secs(60)).remove(0);
    let ctx = RankCtx::open(&ParallelConfig::default(), 0, comm, dev.clone())?;
    let schedule = build(ScheduleKind::OneFOneB, 1, 1, micro)?;
    let exec = Executor::new(&model, &ctx, &schedule, Recompute::None, b, s);
    let mut losses = Vec::with_capacity(steps);
    for _ in 0..steps {
        grads.zero()?;
        losses.push(
            exec.step(&mbs, &grads, &mut (), std::time::Instant::now())?
                .loss,
        );
        opt.step(&grads, r.optimizer.lr, 1.0)?;
        write_params(model.params(), &layout, &opt.master()?)?;
    }
    println!(
        "{{\"optimizer\": \"{}\", \"losses\": {:?}}}",
        r.optimizer.name, losses
    );
    Ok(())
}
