//! The `pretrain plan` command: its arguments, the printed breakdown and ranking table, and the
//! JSON object.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use serde::Serialize;

use super::{candidates, cheapest_fit, plan, GpuPreset, Hardware, MemoryBytes, Plan, GIB};
use crate::cli::RecipeArgs;
use crate::recipe::{Recipe, MAX_RANKS};

/// Arguments of `pretrain plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The recipe.
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// Rank every valid layout for this many GPUs.
    #[arg(long)]
    pub gpus: Option<usize>,
    /// GPU preset.
    #[arg(long, value_enum, default_value_t = GpuPreset::H100)]
    pub gpu: GpuPreset,
    /// GPUs per node (tensor parallelism stays inside a node).
    #[arg(long)]
    pub gpus_per_node: Option<usize>,
    /// Usable memory per GPU, GiB.
    #[arg(long)]
    pub gpu_memory_gib: Option<f64>,
    /// Memory each process needs outside its memory pool (CUDA context, kernels, cuBLAS and
    /// cuDNN workspaces), GiB.
    #[arg(long)]
    pub context_gib: Option<f64>,
    /// NCCL buffers per collective communicator, GiB (a point-to-point one counts half, an
    /// all-to-all one 3.5 times).
    #[arg(long)]
    pub nccl_gib: Option<f64>,
    /// Peak dense bf16 TFLOP/s per GPU.
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Per-GPU collective bandwidth inside a node, gigabytes per second.
    #[arg(long)]
    pub intra_node_gbps: Option<f64>,
    /// Per-GPU collective bandwidth across nodes, gigabytes per second.
    #[arg(long)]
    pub inter_node_gbps: Option<f64>,
    /// Host memory per node, GiB (what an offloaded optimizer state fills).
    #[arg(long)]
    pub host_memory_gib: Option<f64>,
    /// Per-GPU host-device copy bandwidth, one direction, gigabytes per second.
    #[arg(long)]
    pub pcie_gbps: Option<f64>,
    /// Host memory bandwidth per node an offloaded AdamW update reaches, gigabytes per second.
    #[arg(long)]
    pub host_memory_gbps: Option<f64>,
    /// Rates measured on the device (`pretrain bench-rates --json-out`): GEMMs by shape,
    /// attention by head dim and length, element-wise bandwidth, used in place of the preset's
    /// fractions of peak where they hold the shape or one near it.
    #[arg(long)]
    pub rates: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON object to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

impl PlanArgs {
    /// The preset with the flags' overrides.
    pub fn hardware(&self) -> Result<Hardware> {
        let mut hw = self.gpu.hardware();
        // Between 1e-3 and 1e9 of its unit: a value outside describes no machine and only
        // prints absurd times.
        let set = |field: &str, v: Option<f64>, slot: &mut f64| -> Result<()> {
            if let Some(v) = v {
                if !(v.is_finite() && (1e-3..=1e9).contains(&v)) {
                    bail!("--{field} must be a number between 0.001 and 1e9, got {v:.3e}");
                }
                *slot = v;
            }
            Ok(())
        };
        set("gpu-memory-gib", self.gpu_memory_gib, &mut hw.memory_gib)?;
        // The headroom may be zero (to plan the pool alone).
        for (field, v, slot) in [
            ("context-gib", self.context_gib, &mut hw.context_gib),
            ("nccl-gib", self.nccl_gib, &mut hw.nccl_gib),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && (0.0..=1e6).contains(&v)) {
                    bail!("--{field} must be a number between 0 and 1e6, got {v:.3e}");
                }
                *slot = v;
            }
        }
        set("peak-tflops", self.peak_tflops, &mut hw.peak_tflops)?;
        set(
            "intra-node-gbps",
            self.intra_node_gbps,
            &mut hw.intra_node_gbps,
        )?;
        set(
            "inter-node-gbps",
            self.inter_node_gbps,
            &mut hw.inter_node_gbps,
        )?;
        let host = &mut hw.host;
        set(
            "host-memory-gib",
            self.host_memory_gib,
            &mut host.memory_gib,
        )?;
        set("pcie-gbps", self.pcie_gbps, &mut host.pcie_gbps)?;
        set(
            "host-memory-gbps",
            self.host_memory_gbps,
            &mut host.memory_gbps,
        )?;
        if let Some(g) = self.gpus_per_node {
            if g == 0 {
                bail!("--gpus-per-node must be at least 1");
            }
            hw.gpus_per_node = g;
        }
        if let Some(path) = &self.rates {
            hw.rates = Some(super::Rates::load(path)?.leak());
        }
        Ok(hw)
    }
}

/// The JSON object of `pretrain plan --json`.
#[derive(Serialize)]
struct PlanJson<'a> {
    hardware: &'a Hardware,
    #[serde(flatten)]
    plan: &'a Plan,
    #[serde(skip_serializing_if = "Option::is_none")]
    candidates: Option<Vec<&'a Plan>>,
    /// When the recipe's layout does not fit: its fastest variant that does, varying only the
    /// memory levers (ZeRO stage, recompute, moments' dtype, offload).
    #[serde(skip_serializing_if = "Option::is_none")]
    cheapest_fit: Option<&'a Plan>,
}

fn gib(b: u64) -> f64 {
    b as f64 / GIB
}

/// The lines of a plan's breakdown.
pub fn memory_lines(m: &MemoryBytes) -> Vec<String> {
    let mut out = vec![format!(
        "memory per rank (most loaded): {:.2} GiB = parameters {:.2} + gradients {:.2} + optimizer {:.2} + activations {:.2}",
        gib(m.total),
        gib(m.parameters),
        gib(m.gradients),
        gib(m.optimizer),
        gib(m.activations)
    )];
    let extra = m.gathered_parameters + m.staged_gradients;
    out.push(format!(
        "  + ZeRO gathered/staged {:.2} + temporaries and buckets {:.2}",
        gib(extra),
        gib(m.temporaries)
    ));
    if m.host > 0 {
        out.push(format!(
            "  in host memory (optimizer.offload: cpu): {:.2} GiB per rank",
            gib(m.host)
        ));
    }
    out
}

/// A plan's layout, with its layers per pipeline chunk when they are not an equal share.
fn layout_name(p: &Plan) -> String {
    match &p.pipeline_layout {
        Some(l) => format!("{} layers{l:?}", p.layout),
        None => p.layout.to_string(),
    }
}

fn print_plan(p: &Plan, hw: &Hardware) {
    println!("layout: {}", layout_name(p));
    for l in memory_lines(&p.memory_bytes) {
        println!("{l}");
    }
    for s in &p.stages {
        println!(
            "  stage {}: {:.2} GiB (activations {:.2} GiB, {} micro-batches in flight)",
            s.stage,
            gib(s.bytes.total),
            gib(s.bytes.activations),
            s.in_flight
        );
    }
    let c = &p.communicators;
    println!(
        "  outside the memory pool: {:.2} GiB (context and libraries {:.2}; NCCL {} collective, \
         {} all-to-all, {} ring, {} point-to-point communicators)",
        gib(p.headroom_bytes),
        hw.context_gib,
        c.groups,
        c.all_to_all,
        c.rings,
        c.p2p
    );
    let host = if p.memory_bytes.host > 0 && hw.is_gpu() {
        let ranks = hw.gpus_per_node.min(p.layout.world()) as u64;
        format!(
            "; host memory {:.1} GiB of the node's {:.0} ({ranks} ranks)",
            gib(ranks * p.memory_bytes.host),
            hw.host.memory_gib
        )
    } else {
        String::new()
    };
    println!(
        "fits {} ({:.1} GiB): {}{host}",
        hw.name,
        hw.memory_gib,
        if p.fits { "yes" } else { "NO" }
    );
    for why in &p.refused {
        println!("  refused at start-up: {why}");
    }
    let t = &p.step_time;
    println!(
        "step {:.3} s = compute {:.3} + TP {:.3} + PP {:.3} + bubble {:.3} ({:.1}%) + DP exposed {:.3} (of {:.3}) + optimizer {:.3}",
        t.step_s,
        t.compute_s,
        t.tp_comm_s,
        t.pp_comm_s,
        t.bubble_s,
        100.0 * p.bubble,
        t.dp_exposed_s,
        t.dp_comm_s,
        t.optimizer_s
    );
    println!(
        "throughput: {:.0} tokens/s, {:.0} TFLOP/s per GPU, MFU {:.1}%",
        p.tokens_per_s,
        p.tflops_per_gpu,
        100.0 * p.mfu
    );
    if p.attention_share < 1.0 {
        println!(
            "attention: the document mask keeps {:.1}% of the causal pairs (the work counted)",
            100.0 * p.attention_share
        );
    }
    if let Some(b) = &p.balanced {
        let layers = b.pipeline_layout.as_deref().unwrap_or_default();
        println!(
            "balanced stages: --set 'parallel.pipeline_layout={layers:?}' (the embedding and the \
             head counted where they sit): step {:.3} s, {:.0} tokens/s, {:.2} GiB per rank",
            b.step_time_s,
            b.tokens_per_s,
            gib(b.memory_bytes.total)
        );
    }
}

/// Samples of the training data `pretrain plan` reads to measure the attention a document
/// mask keeps (every sample of a shorter run).
const ATTENTION_SAMPLES: u64 = 4096;

/// `r` with `data.attention_share` measured on its training data when a document mask is on
/// and the recipe does not give it; a recipe whose data cannot be opened here is planned with
/// causal attention, and stderr says so.
fn with_attention_share(mut r: Recipe) -> Recipe {
    let d = &r.data;
    if !d.reset_attention_mask || d.attention_share.is_some() {
        return r;
    }
    let t = &r.train;
    let measured = data::GptData::open(
        d,
        std::path::Path::new("."),
        data::Split::Train,
        t.seq_len,
        t.seed,
        (t.steps * t.global_batch) as u64,
    )
    .and_then(|g| data::attention_share(&g, ATTENTION_SAMPLES).map(|a| (a, g.num_samples())));
    match measured {
        Ok((a, n)) => {
            eprintln!(
                "data.attention_share: {a:.4}, measured on {} of the run's {n} training samples",
                n.min(ATTENTION_SAMPLES)
            );
            r.data.attention_share = Some(a);
        }
        Err(e) => eprintln!(
            "data.attention_share: cannot measure it ({e}); attention planned as causal (set \
             it to plan with documents kept apart)"
        ),
    }
    r
}

/// Runs `pretrain plan`.
pub fn run(args: &PlanArgs) -> Result<()> {
    let r = with_attention_share(args.recipe.load()?);
    let hw = args.hardware()?;
    let own = plan(&r, &hw)?;
    let ranked = match args.gpus {
        Some(0) => bail!("--gpus must be at least 1"),
        Some(n) if n > MAX_RANKS => bail!(
            "--gpus {n} exceeds {MAX_RANKS}, the most ranks a recipe may have (parallel.dp × tp × \
             cp × pp)"
        ),
        Some(n) if n > hw.gpus_per_node && !n.is_multiple_of(hw.gpus_per_node) => bail!(
            "--gpus {n} is not a whole number of nodes of {} GPUs (--gpus-per-node)",
            hw.gpus_per_node
        ),
        Some(n) => {
            let c = candidates(&r, &hw, n);
            if c.is_empty() {
                bail!(
                    "no layout of {} runs on exactly {n} GPUs: dp × tp × cp × pp must be {n}, \
                     with cp = {} kept, tp at most {} (a node), pp at most the {} layers and dp \
                     dividing train.global_batch = {} (and tp the heads, ep the experts)",
                    args.recipe.recipe.display(),
                    r.parallel.cp,
                    hw.gpus_per_node,
                    r.model.num_hidden_layers,
                    r.train.global_batch
                );
            }
            Some(c)
        }
        None => None,
    };
    let fit = (!own.fits).then(|| cheapest_fit(&r, &hw)).flatten();
    // Every candidate's plan in JSON is large (thousands at 64 GPUs): written only when asked.
    if args.json || args.json_out.is_some() {
        let json = PlanJson {
            hardware: &hw,
            plan: &own,
            candidates: ranked.as_ref().map(|c| c.iter().map(|c| &c.plan).collect()),
            cheapest_fit: fit.as_ref(),
        };
        let text = serde_json::to_string(&json)?;
        if let Some(path) = &args.json_out {
            crate::files::write_replacing(path, text.as_bytes())?;
        }
        if args.json {
            println!("{text}");
            return Ok(());
        }
    }
    println!(
        "{} on {} ({} GPUs/node):",
        args.recipe.recipe.display(),
        hw.name,
        hw.gpus_per_node
    );
    print_plan(&own, &hw);
    if !own.fits {
        match &fit {
            Some(p) => println!(
                "fits with {} ({:.2} GiB per rank, step {:.3} s, {:.0} tokens/s)",
                own.layout.lever_flags(&p.layout),
                gib(p.memory_bytes.total),
                p.step_time_s,
                p.tokens_per_s
            ),
            None => println!(
                "no ZeRO stage, recompute or moments' dtype makes this layout fit; see --gpus N \
                 for other layouts"
            ),
        }
    }
    if let (Some(n), Some(c)) = (args.gpus, &ranked) {
        let fitting = c.iter().filter(|c| c.plan.fits).count();
        println!();
        println!(
            "{} valid layouts for {n} GPUs, {fitting} fit {:.1} GiB; the best ten by throughput (* = the recipe's):",
            c.len(),
            hw.memory_gib
        );
        println!(
            "  {:<3} {:<44} {:>9} {:>9} {:>12} {:>8} {:>6} {:>7}",
            "#", "layout", "GiB/rank", "step s", "tokens/s", "TFLOP/s", "MFU", "bubble"
        );
        let row = |i: String, c: &super::Candidate| {
            let p = &c.plan;
            println!(
                "{}{:<3} {:<44} {:>9.2} {:>9.3} {:>12.0} {:>8.0} {:>5.1}% {:>6.1}%",
                if c.own { "*" } else { " " },
                i,
                layout_name(p),
                gib(p.memory_bytes.total),
                p.step_time_s,
                p.tokens_per_s,
                p.tflops_per_gpu,
                100.0 * p.mfu,
                100.0 * p.bubble
            );
        };
        for (i, cand) in c.iter().filter(|c| c.plan.fits).take(10).enumerate() {
            row((i + 1).to_string(), cand);
        }
        if let Some((i, cand)) = c.iter().enumerate().find(|(_, c)| c.own) {
            if !(cand.plan.fits && i < 10) {
                row("-".into(), cand);
            }
        }
    }
    Ok(())
}
