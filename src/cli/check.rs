//! `pretrain check`: validates a recipe, opens its data (unless `--no-data`), and prints the
//! model, layout, batch and the predicted memory of the most loaded rank.

use anyhow::{Context, Result};

use super::RecipeArgs;
use crate::recipe::Recipe;

/// Opens what a run opens first: the tokenizer and the training split of every dataset (token
/// ids checked against the vocabulary), and the validation split when the run validates.
fn check_data(r: &Recipe) -> Result<()> {
    let (t, m) = (&r.train, &r.model);
    let open = |split: data::Split, samples: usize| {
        let what = match split {
            data::Split::Train => "training",
            _ => "validation",
        };
        let data = data::GptData::open(
            &r.data,
            std::path::Path::new("."),
            split,
            t.seq_len,
            t.seed,
            samples as u64,
        );
        data.with_context(|| format!("opening the {what} data (pretrain check --no-data skips it)"))
    };
    let data = open(data::Split::Train, t.steps * t.global_batch)?;
    if t.eval_interval > 0 {
        open(data::Split::Valid, t.eval_batches * t.global_batch)?;
    }
    if data.vocab_size() > m.vocab_size {
        anyhow::bail!(
            "model.vocab_size ({}) is smaller than the tokenizer's vocabulary ({})",
            m.vocab_size,
            data.vocab_size()
        );
    }
    println!(
        "data: {} dataset(s), {} training samples drawn; tokenizer {} ({} ids)",
        r.data.datasets.len(),
        data.num_samples(),
        r.data.tokenizer.display(),
        data.vocab_size()
    );
    Ok(())
}

/// Checks the recipe of `args` (and its data with `open_data`), printing what it describes.
pub(super) fn check(args: &RecipeArgs, open_data: bool) -> Result<()> {
    let r = args.load()?;
    let m = &r.model;
    if open_data {
        check_data(&r)?;
    }
    // The memory model builds the step's pipeline schedule (zbv's order within its caps): a
    // recipe whose schedule cannot be built is not valid.
    let stages = crate::plan::memory::stages(&r)?;
    println!("{}: valid", args.recipe.display());
    println!(
        "model: {:.3}B parameters ({} layers, hidden {}, {} heads / {} kv heads of {}, ffn {}, vocab {}, RoPE θ = {}{})",
        m.num_params() as f64 / 1e9,
        m.num_hidden_layers,
        m.hidden_size,
        m.num_attention_heads,
        m.num_key_value_heads,
        m.head_dim(),
        m.intermediate_size,
        m.vocab_size,
        m.rope_theta,
        m.rope_scaling
            .map(|s| format!(" with {} scaling", s.name()))
            .unwrap_or_default()
    );
    if let Some(moe) = m.moe() {
        let layers = m.num_moe_layers();
        println!(
            "experts: {} MoE layers of {} experts (ffn {}), {} per token; {} parameters in all, \
             {} active per token ({:.1}%)",
            layers,
            moe.num_experts,
            moe.expert_size,
            moe.top_k,
            m.num_params(),
            m.num_active_params(),
            100.0 * m.num_active_params() as f64 / m.num_params() as f64
        );
        let p = &r.parallel;
        if p.ep > 1 {
            println!(
                "expert parallelism: ep={} inside dp={}, {} experts per rank and layer, expert \
                 gradients reduced over {} ranks",
                p.ep,
                p.dp,
                moe.num_experts / p.ep,
                p.expert_grad_ranks()
            );
        }
    }
    let p = &r.parallel;
    println!(
        "layout: dp={} tp={} cp={} pp={} (virtual {}) = {} ranks, sequence_parallel={}, zero={} (shard groups of {})",
        p.dp,
        p.tp,
        p.cp,
        p.pp,
        p.virtual_stages,
        p.world_size(),
        p.sequence_parallel,
        p.zero,
        p.shard_size()
    );
    println!(
        "batch: {} sequences × {} tokens = {} tokens/step; micro-batch {}, {} accumulation steps per rank",
        r.train.global_batch,
        r.train.seq_len,
        r.train.global_batch * r.train.seq_len,
        r.train.micro_batch,
        r.grad_accum_steps()
    );
    if let Some(most) = stages.iter().max_by_key(|s| s.bytes.total) {
        for l in crate::plan::report::memory_lines(&most.bytes) {
            println!("{l}");
        }
    }
    // Against this machine (CPU jobs; a GPU is not opened here): training would refuse it.
    if r.train.device == crate::recipe::DeviceKind::Cpu {
        let world = r.parallel.world_size();
        if let Some(a) = crate::train::admit::assess(&r, world, &candle_core::Device::Cpu)? {
            if !a.fits() {
                println!(
                    "warning: {}; training here would refuse to start",
                    a.describe(&r, &candle_core::Device::Cpu)
                );
            }
        }
    }
    Ok(())
}
