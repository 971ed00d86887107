//! Typed training recipes: YAML files with `inherit:`, `--set a.b=value` overrides and validation
//! of every inconsistency before anything is allocated.

mod fp8;
mod load;
mod optimizer;
mod sections;
mod validate;

use data::DataConfig;
use model::LlamaConfig;
use parallel::ParallelConfig;
use serde::{Deserialize, Serialize};

pub use fp8::{device_problem as fp8_device_problem, Fp8Config, Fp8GemmKind, Fp8Mode};
pub use load::{load, load_stored, load_str, RecipeError};
pub use optimizer::{AdjustLr, MuonConfig, Offload, OptimizerConfig, OptimizerName, StateDtype};
pub use sections::{
    CheckpointConfig, DeviceKind, Dtype, LrCurve, OnNonFinite, Resume, ResumeChange, RunConfig,
    ScheduleConfig, StepTiming, TrainConfig, SPIKE_WINDOW,
};
pub use validate::MAX_RANKS;

/// A complete training recipe. Every key of the YAML file maps to a documented field here or in
/// the section types; unknown keys are errors.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// The model's shape (Hugging Face `LlamaConfig` names).
    pub model: LlamaConfig,
    /// Datasets, tokenizer and split.
    pub data: DataConfig,
    /// Parallel layout.
    #[serde(default)]
    pub parallel: ParallelConfig,
    /// Steps, batch sizes, sequence length, numerics.
    pub train: TrainConfig,
    /// AdamW hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule.
    pub schedule: ScheduleConfig,
    /// Saving and resuming.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// Outputs and logging.
    #[serde(default)]
    pub run: RunConfig,
}

impl Recipe {
    /// Gradient-accumulation steps per optimizer step: `global_batch / (micro_batch × dp)`.
    pub fn grad_accum_steps(&self) -> usize {
        self.train.global_batch / (self.train.micro_batch * self.parallel.dp)
    }

    /// The directory holding the run's step directories: `checkpoint.dir`, by default
    /// `run.dir/checkpoints`.
    pub fn checkpoint_root(&self) -> std::path::PathBuf {
        self.checkpoint
            .dir
            .clone()
            .unwrap_or_else(|| self.run.dir.join("checkpoints"))
    }
}
