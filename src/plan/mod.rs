//! `pretrain plan`: memory and step time of a layout before anything is allocated, and the
//! ranking of every valid layout for a number of GPUs.
//!
//! A plan is a pure function of the recipe and the [`Hardware`]: the state bytes come from the
//! flat layout the trainer builds (`parallel::dp::StateLayout`), the activations from
//! what each piece's tape keeps walked through the stage's pipeline schedule ([`memory`]), the
//! time from a roofline of every piece plus the collectives ([`time`]). `docs/PLANNER.md` has
//! the formulas, their sources and the checks against our runs and published results.

mod acts;
pub mod choose;
mod error;
mod fp8;
pub mod hardware;
mod memo;
pub mod memory;
pub mod rates;
pub mod report;
mod roofline;
pub mod search;
pub mod time;

use parallel::pipeline::ScheduleKind;
use serde::Serialize;

pub use error::PlanError;
pub use hardware::{GpuPreset, Hardware, Host};
pub use memory::{MemoryBytes, StageMemory};
pub use rates::Rates;
pub use search::{candidates, cheapest_fit, Candidate};
pub use time::StepTime;

use crate::recipe::{Offload, Recipe, StateDtype};

/// A layout: the recipe keys the planner varies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Layout {
    /// Data-parallel size.
    pub dp: usize,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Context-parallel size (kept at the recipe's by the search).
    pub cp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Expert-parallel size (inside `dp`; 1 for a dense model).
    pub ep: usize,
    /// Model chunks per stage.
    pub virtual_stages: usize,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// Sequence parallelism.
    pub sequence_parallel: bool,
    /// ZeRO stage.
    pub zero: parallel::dp::ZeroStage,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Activation recompute (`selective` with the recipe's `recompute_modules`).
    pub recompute: model::Recompute,
    /// Element type of the AdamW moments.
    pub state_dtype: StateDtype,
    /// Where AdamW's state lives.
    pub offload: Offload,
}

impl Layout {
    /// Its ranks.
    pub fn world(&self) -> usize {
        self.dp * self.tp * self.cp * self.pp
    }

    /// The layout of a recipe.
    pub fn of(r: &Recipe) -> Self {
        let p = &r.parallel;
        Self {
            dp: p.dp,
            tp: p.tp,
            cp: p.cp,
            pp: p.pp,
            ep: p.ep,
            virtual_stages: p.virtual_stages,
            schedule: p.schedule_kind(),
            sequence_parallel: p.sequence_parallel,
            zero: p.zero,
            micro_batch: r.train.micro_batch,
            recompute: r.train.recompute,
            state_dtype: r.optimizer.state_dtype,
            offload: r.optimizer.offload,
        }
    }

    /// `r` with this layout (ZeRO shard groups reset to the whole data-parallel group unless
    /// they still divide it).
    pub fn apply(&self, r: &Recipe) -> Recipe {
        let mut r = r.clone();
        let p = &mut r.parallel;
        let placement = |k: ScheduleKind| k.placement();
        if (p.pp, p.virtual_stages) != (self.pp, self.virtual_stages)
            || placement(p.schedule_kind()) != placement(self.schedule)
        {
            p.pipeline_layout = None; // the recipe's chunks are not this layout's
        }
        // The schedule is named only where it is not the default for its chunks.
        let default = ScheduleKind::for_virtual_stages(self.virtual_stages);
        p.schedule = (self.schedule != default).then_some(self.schedule);
        (p.dp, p.tp, p.cp) = (self.dp, self.tp, self.cp);
        (p.pp, p.virtual_stages, p.ep) = (self.pp, self.virtual_stages, self.ep);
        (p.sequence_parallel, p.zero) = (self.sequence_parallel, self.zero);
        if !self.zero.shards_optimizer()
            || p.zero_shard_size
                .is_some_and(|n| !(self.dp * self.cp).is_multiple_of(n))
        {
            p.zero_shard_size = None;
        }
        r.train.micro_batch = self.micro_batch;
        r.train.recompute = self.recompute;
        if self.recompute != model::Recompute::Selective {
            r.train.recompute_modules = None; // they name what only `selective` recomputes
        }
        r.optimizer.state_dtype = self.state_dtype;
        r.optimizer.offload = self.offload;
        r
    }

    /// The `--set` flags that turn this layout into `to`, naming the memory levers that differ
    /// (ZeRO stage, recompute, the moments' dtype, offload).
    pub fn lever_flags(&self, to: &Layout) -> String {
        let mut out = Vec::new();
        if self.zero != to.zero {
            out.push(format!("--set parallel.zero={}", to.zero));
        }
        if self.recompute != to.recompute {
            out.push(format!("--set train.recompute={}", to.recompute));
        }
        if self.state_dtype != to.state_dtype {
            out.push(format!("--set optimizer.state_dtype={}", to.state_dtype));
        }
        if self.offload != to.offload {
            out.push(format!("--set optimizer.offload={}", to.offload));
        }
        out.join(" ")
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "dp{} tp{}", self.dp, self.tp)?;
        if self.sequence_parallel {
            f.write_str("+sp")?;
        }
        if self.cp > 1 {
            write!(f, " cp{}", self.cp)?;
        }
        write!(f, " pp{}", self.pp)?;
        if self.virtual_stages > 1 {
            write!(f, "x{}", self.virtual_stages)?;
        }
        if matches!(
            self.schedule,
            ScheduleKind::ZeroBubbleH1 | ScheduleKind::ZeroBubbleV
        ) {
            write!(f, " {}", self.schedule.recipe_name())?;
        }
        if self.ep > 1 {
            write!(f, " ep{}", self.ep)?;
        }
        let rc = match self.recompute {
            model::Recompute::None => "",
            model::Recompute::Selective => " rc:sel",
            model::Recompute::Full => " rc",
        };
        write!(f, " z{} mb{}{rc}", self.zero, self.micro_batch)?;
        if self.state_dtype == StateDtype::Bf16 {
            f.write_str(" m:bf16")?;
        }
        if self.offload == Offload::Cpu {
            f.write_str(" off:cpu")?;
        }
        Ok(())
    }
}

/// The prediction for one layout.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// The layout.
    pub layout: Layout,
    /// Bytes of the most loaded rank.
    pub memory_bytes: MemoryBytes,
    /// Each pipeline stage's bytes.
    pub stages: Vec<StageMemory>,
    /// The NCCL communicators of the rank that holds the most.
    pub communicators: parallel::register::Communicators,
    /// What a rank needs outside its memory pool: context, libraries, NCCL buffers
    /// ([`Hardware::headroom_bytes`]).
    pub headroom_bytes: u64,
    /// Whether the most loaded rank, with the headroom, fits the GPU's memory, its offloaded
    /// state the node's host memory ([`Hardware::host_holds`]), and no tensor of any rank passes
    /// what the GPU's kernels can index ([`Plan::refused`]).
    pub fits: bool,
    /// Why the trainer would refuse the layout on the GPU (`device::element_problems`); empty
    /// when it admits it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<String>,
    /// Step time, by part.
    pub step_time: StepTime,
    /// Predicted seconds per step.
    pub step_time_s: f64,
    /// Training tokens per second over all GPUs.
    pub tokens_per_s: f64,
    /// Model TFLOP/s per GPU (`LlamaConfig::flops_per_token`, recomputation not counted, the
    /// attention a document mask skips not counted).
    pub tflops_per_gpu: f64,
    /// The share of the causal attention pairs computed ([`time::attention_share`]).
    pub attention_share: f64,
    /// Model FLOPs utilisation.
    pub mfu: f64,
    /// Pipeline bubble as a fraction of the pipeline phase.
    pub bubble: f64,
    /// The layers of each pipeline chunk when they are not an equal share
    /// (`parallel.pipeline_layout`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_layout: Option<Vec<usize>>,
    /// With pipeline parallelism: the plan with the stages balanced by
    /// [`time::balanced_layout`], when that is faster than this one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub balanced: Option<Box<Plan>>,
}

/// Plans `r`'s own layout on `hw` (the recipe must be valid), with the plan of its stages
/// balanced when that is faster ([`Plan::balanced`]).
pub fn plan(r: &Recipe, hw: &Hardware) -> Result<Plan, PlanError> {
    let mut own = plan_layout(r, hw)?;
    let layers = r.model.num_hidden_layers;
    if let Some(l) = time::balanced_layout(r, hw).filter(|l| *l != r.parallel.chunk_layers(layers))
    {
        let mut rb = r.clone();
        rb.parallel.pipeline_layout = Some(l);
        if rb.problems().is_empty() {
            let b = plan_layout(&rb, hw)?;
            if b.step_time_s < own.step_time_s && (b.fits || !own.fits) {
                own.balanced = Some(Box::new(b));
            }
        }
    }
    Ok(own)
}

/// Plans `r`'s layout as it is.
fn plan_layout(r: &Recipe, hw: &Hardware) -> Result<Plan, PlanError> {
    let stages = memory::stages(r)?;
    let most = stages
        .iter()
        .max_by_key(|s| s.bytes.total)
        .ok_or(PlanError::NoStage)?;
    let state: Vec<time::StageState> = stages
        .iter()
        .map(|s| time::StageState {
            total: s.flat_elems as f64,
            owned: s.owned_elems as f64,
            params: s.param_elems as f64,
        })
        .collect();
    let (step_time, bubble) = time::step_time(r, hw, &state);
    let communicators = memo::most_communicators(&r.parallel)?;
    let headroom_bytes = hw.headroom_bytes(&communicators);
    // The trainer's start-up limits (the activations candle's kernels process whole).
    let refused = if hw.is_gpu() {
        crate::device::element_problems(r)
    } else {
        Vec::new()
    };
    // On the CPU the offloaded state shares the ranks' memory.
    let device = most.bytes.total + if hw.is_gpu() { 0 } else { most.bytes.host };
    let world = r.parallel.world_size() as f64;
    let tokens = (r.train.global_batch * r.train.seq_len) as f64;
    // The work done: the attention a document mask skips is not counted (as the trainer's
    // TFLOP/s and MFU do not count it).
    let s = r.train.seq_len;
    let skipped = r.model.attention_flops_per_token(s) * (1.0 - time::attention_share(r));
    let tflops = tokens * (r.model.flops_per_token(s) - skipped) / step_time.step_s / world / 1e12;
    Ok(Plan {
        layout: Layout::of(r),
        memory_bytes: most.bytes,
        communicators,
        headroom_bytes,
        fits: (device + headroom_bytes) as f64 <= hw.memory_gib * GIB
            && hw.host_holds(most.bytes.host, r.parallel.world_size())
            && refused.is_empty(),
        refused,
        stages,
        step_time,
        step_time_s: step_time.step_s,
        tokens_per_s: tokens / step_time.step_s,
        tflops_per_gpu: tflops,
        attention_share: time::attention_share(r),
        mfu: tflops / hw.peak_tflops,
        bubble,
        pipeline_layout: r.parallel.pipeline_layout.clone(),
        balanced: None,
    })
}

/// Bytes per GiB.
pub const GIB: f64 = (1u64 << 30) as f64;
