//! The recipe's own sections (`train`, `schedule`, `checkpoint`, `run`; `optimizer` in
//! `optimizer.rs`); `model`, `data` and `parallel` are defined by the crates that use them.

use std::path::PathBuf;

use model::{AttentionBackend, Recompute, RecomputeModule, Recomputed};
use serde::{Deserialize, Serialize};

/// Element type of parameters and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit floats everywhere.
    F32,
    /// bfloat16 parameters and activations; fp32 master weights, moments and gradient buffers.
    Bf16,
}

/// Where the ranks compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// Host CPU (all cores shared by the ranks).
    Cpu,
    /// One CUDA GPU per rank (needs the `cuda` build).
    Cuda,
}

impl Dtype {
    /// The tensor dtype of parameters and activations.
    pub fn dtype(self) -> candle_core::DType {
        match self {
            Dtype::F32 => candle_core::DType::F32,
            Dtype::Bf16 => candle_core::DType::BF16,
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        })
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// `train:` — how long and on what batches to train.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Optimizer steps to run.
    pub steps: usize,
    /// Sequences per optimizer step, over all data-parallel ranks.
    pub global_batch: usize,
    /// Sequences per forward/backward pass on one rank. Gradient accumulation steps are
    /// `global_batch / (micro_batch × parallel.dp)`.
    pub micro_batch: usize,
    /// Tokens per training sequence.
    pub seq_len: usize,
    /// Seed of the initialisation and of the data order.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Clip the global gradient norm to this value; 0 disables clipping.
    #[serde(default = "default_clip")]
    pub grad_clip: f64,
    /// Activation recompute: `none` keeps every layer's activations, `selective` keeps them
    /// without `recompute_modules` (recomputed in each block's backward), `full` keeps only
    /// layer inputs.
    #[serde(default)]
    pub recompute: Recompute,
    /// What `recompute: selective` recomputes: `layernorm` (both norms' outputs), `mlp_act`
    /// (the dense MLP's SwiGLU), `moe_act` (the experts' SwiGLU), `core_attn` (attention's
    /// output, one more attention forward per backward). Default: `[layernorm, mlp_act,
    /// moe_act]`, the cheap, memory-heavy ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_modules: Option<Vec<RecomputeModule>>,
    /// Removed: every piece has one forward and its hand-written backward (autograd over the same
    /// ops is the tests' reference, not a training mode). Read only to refuse it with the reason.
    #[serde(default, skip_serializing)]
    pub backward: Option<serde_yaml::Value>,
    /// Parameter and activation dtype.
    #[serde(default = "default_dtype")]
    pub dtype: Dtype,
    /// Compute device.
    #[serde(default = "default_device")]
    pub device: DeviceKind,
    /// Attention kernels: `cudnn` (cuDNN's fused attention for bf16; the default on CUDA) or
    /// `own` (the project's kernels; the default, and the only choice, on the CPU). See
    /// [`TrainConfig::attention_backend`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionBackend>,
    /// Run validation every this many steps (and after the last step); 0 disables it.
    #[serde(default)]
    pub eval_interval: usize,
    /// Global batches per validation run (always the same held-out samples, whatever the layout:
    /// `eval_batches × global_batch` sequences from the start of the validation split).
    #[serde(default = "default_eval_batches")]
    pub eval_batches: usize,
    /// What a step with a non-finite loss or gradient norm (or a loss spike) does: `halt` stops
    /// the run before the update, `skip` discards the update and goes on.
    #[serde(default)]
    pub on_nonfinite: OnNonFinite,
    /// With `on_nonfinite: skip`, the run halts after this many skipped steps in a row.
    #[serde(default = "default_max_skips")]
    pub max_skips: usize,
    /// A step whose loss exceeds this factor × the mean loss of the last
    /// [`SPIKE_WINDOW`] steps is a loss spike, handled as `on_nonfinite` says; unset disables it.
    #[serde(default)]
    pub spike_factor: Option<f64>,
    /// Every run of the same recipe and data sums in the same order, so a resumed run equals
    /// the uninterrupted one bit for bit (the default). `false` lets cuDNN's attention backward
    /// accumulate with atomics (faster, less workspace; PyTorch's default), giving that up; it
    /// changes nothing else (every other kernel here is deterministic either way).
    #[serde(default = "super::optimizer::default_true")]
    pub deterministic: bool,
    /// The blocks' linears in FP8 (`src/recipe/fp8.rs`); off by default.
    #[serde(default, skip_serializing_if = "super::Fp8Config::is_off")]
    pub fp8: super::Fp8Config,
}

impl TrainConfig {
    /// The attention backend: `train.attention`, else cuDNN's on CUDA and the project's kernels
    /// on the CPU (where `cudnn` is refused by the recipe's validation).
    /// With `deterministic: false`, cuDNN's is its non-deterministic backward.
    pub fn attention_backend(&self) -> AttentionBackend {
        let backend = match (self.attention, self.device) {
            (Some(b), _) => b,
            (None, DeviceKind::Cuda) => AttentionBackend::Cudnn,
            (None, DeviceKind::Cpu) => AttentionBackend::Own,
        };
        match backend {
            AttentionBackend::Cudnn if !self.deterministic => {
                AttentionBackend::CudnnNondeterministic
            }
            b => b,
        }
    }

    /// What is wrong with `attention` and `deterministic` together with `device`.
    pub fn attention_problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.attention == Some(AttentionBackend::Cudnn) && self.device == DeviceKind::Cpu {
            p.push(
                "train.attention is cudnn, which needs train.device cuda (on the CPU the \
                 project's kernels run: `own`, or leave train.attention unset)"
                    .into(),
            );
        } else if !self.deterministic && self.attention_backend() == AttentionBackend::Own {
            p.push(
                "train.deterministic is false, which changes only cuDNN's attention backward \
                 (train.attention: cudnn, on CUDA); the project's kernels are deterministic"
                    .into(),
            );
        }
        p
    }

    /// What blocks leave out of their tapes: `recompute_modules` (or the default set) under
    /// `recompute: selective`, nothing otherwise.
    pub fn recomputed(&self) -> Recomputed {
        let modules = self
            .recompute_modules
            .as_deref()
            .unwrap_or(&RecomputeModule::DEFAULT);
        Recomputed::of(self.recompute, modules)
    }
}

/// Steps in the running mean that loss spikes are measured against.
pub const SPIKE_WINDOW: usize = 20;

/// What to do with a step whose loss or gradients are not finite, or whose loss spiked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnNonFinite {
    /// Stop the run with an error naming the step and the ranks (the last checkpoint stays).
    #[default]
    Halt,
    /// Discard the step's update (data and step count still advance) and log it.
    Skip,
}

fn default_seed() -> u64 {
    1234
}
fn default_clip() -> f64 {
    1.0
}
fn default_dtype() -> Dtype {
    Dtype::F32
}
fn default_device() -> DeviceKind {
    DeviceKind::Cpu
}
fn default_eval_batches() -> usize {
    1
}
fn default_max_skips() -> usize {
    5
}

/// Shape of the learning-rate curve after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrCurve {
    /// Stay at the peak.
    Constant,
    /// Cosine from the peak down to `min_lr` at the last step.
    Cosine,
    /// Warmup–stable–decay: the peak until the last `decay_fraction` of steps, then linear to `min_lr`.
    Wsd,
}

/// `schedule:` — the learning-rate schedule.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    /// Curve after warmup.
    pub kind: LrCurve,
    /// Steps of linear warmup from 0 to the peak.
    #[serde(default)]
    pub warmup_steps: usize,
    /// Final learning rate of `cosine` and `wsd`.
    #[serde(default)]
    pub min_lr: f64,
    /// Fraction of all steps spent decaying (`wsd` only).
    #[serde(default = "default_decay_fraction")]
    pub decay_fraction: f64,
}

fn default_decay_fraction() -> f64 {
    0.2
}

/// Which checkpoint a run starts from: `none`, `auto`, or any other string as a step directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase", from = "String")]
pub enum Resume {
    /// Start from the seeded initialisation (refused where the checkpoint directory already
    /// holds checkpoints, which this run would save over).
    #[default]
    None,
    /// The newest complete checkpoint in the checkpoint directory, if any.
    Auto,
    /// This step directory.
    #[serde(untagged)]
    Path(PathBuf),
}

impl From<String> for Resume {
    fn from(s: String) -> Self {
        match s.as_str() {
            "none" => Resume::None,
            "auto" => Resume::Auto,
            _ => Resume::Path(s.into()),
        }
    }
}

/// `checkpoint:` — saving and resuming.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Save every this many steps (and after the last step); 0 disables saving.
    #[serde(default)]
    pub interval: usize,
    /// How many of the newest checkpoints to keep.
    #[serde(default = "default_keep")]
    pub keep: usize,
    /// Where to start from: `none`, `auto` or a step directory.
    #[serde(default)]
    pub resume: Resume,
    /// Directory of the step directories; default `<run.dir>/checkpoints`.
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// Copy the state to host memory at the step boundary and write the checkpoint on a
    /// background thread while training goes on (at most one save in flight).
    #[serde(default, rename = "async")]
    pub async_save: bool,
    /// What a resume may change from the checkpoint's recipe that it otherwise refuses: `seed`
    /// (the data order from there on), `data` (the `data:` section: datasets, blend weights,
    /// split; or the datasets' files on disk), `optimizer` (`optimizer.name`), `seq_len` (`train.seq_len`), `tokenizer` (the
    /// tokenizer file's contents) and `model` (settings that keep every tensor's shape). A
    /// model of other shapes is always refused; other changes of `train`, `optimizer` and
    /// `schedule` are said in the log.
    #[serde(default)]
    pub accept_changes: Vec<ResumeChange>,
    /// How long the ranks of a save wait for each other (its barriers, and rank 0 for the others'
    /// shares when saving in the background), seconds: separate from `parallel.timeout_s`
    /// because a shared file system with many writers can take far longer than any collective.
    #[serde(default = "default_save_timeout")]
    pub timeout_s: f64,
}

/// A recipe change a resume accepts when asked to ([`CheckpointConfig::accept_changes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResumeChange {
    /// `train.seed`.
    Seed,
    /// The `data:` section.
    Data,
    /// `optimizer.name` (the other optimizer's state starts at zero).
    Optimizer,
    /// `train.seq_len` (samples are counted in sequences, so the data position moves: a
    /// context-length extension, say).
    #[serde(rename = "seq_len")]
    SeqLen,
    /// `data.tokenizer`'s contents (the token ids would stand for other text).
    Tokenizer,
    /// Model settings that keep every tensor's shape (`rope_theta`, `max_position_embeddings`,
    /// `initializer_range`, router coefficients, ...).
    Model,
}

fn default_keep() -> usize {
    3
}

fn default_save_timeout() -> f64 {
    1800.0
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            interval: 0,
            keep: default_keep(),
            resume: Resume::None,
            dir: None,
            accept_changes: Vec::new(),
            async_save: false,
            timeout_s: default_save_timeout(),
        }
    }
}

/// `run:` — where outputs go and how often to log.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Output directory (metrics, plot, resolved recipe, checkpoints).
    #[serde(default = "default_dir")]
    pub dir: PathBuf,
    /// Print a log line every this many steps.
    #[serde(default = "one")]
    pub log_interval: usize,
    /// Peak dense throughput of one device in TFLOP/s, used for MFU; omitted on CPU (MFU is then
    /// not reported) and looked up from the GPU model on CUDA when absent.
    #[serde(default)]
    pub peak_tflops: Option<f64>,
    /// Write the timeline of this step (every rank's forward, backward, send, receive and
    /// optimizer spans) as a Chrome/Perfetto trace to `<dir>/trace.json` (pipeline parallel runs).
    #[serde(default)]
    pub trace_step: Option<usize>,
    /// Also write the logged scalars (loss, learning rate, gradient norm, throughput, MFU,
    /// memory, validation loss) as TensorBoard event files under `<dir>/tensorboard/`.
    #[serde(default)]
    pub tensorboard: bool,
    /// At each log interval every rank's compute time is compared: a rank slower than this
    /// many times the median is named as a straggler in the log and in `metrics.jsonl`.
    #[serde(default = "default_straggler_factor")]
    pub straggler_factor: f64,
    /// How a GPU step is timed (see [`StepTiming`]).
    #[serde(default)]
    pub timing: StepTiming,
}

/// How a step on a GPU is timed and where the host waits for the device (`run.timing`). On the
/// CPU, whose work is done when its call returns, both give the same times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepTiming {
    /// The host does not wait for the update: it logs and queues the next step while the device
    /// runs it. A step's time is its cadence, from the previous step's end to its own; the
    /// traced and the last step, and a step a validation or checkpoint follows, wait for the
    /// device at their start and end and are timed on their own. `optimizer_s` is the time to
    /// queue the update, except on those steps.
    #[default]
    Overlapped,
    /// The host waits for the device after the update and at every step's end: each step's
    /// times are the device's own, and the device idles while the host logs and prepares the
    /// next step.
    Synchronized,
}

fn default_straggler_factor() -> f64 {
    1.2
}

fn default_dir() -> PathBuf {
    PathBuf::from("runs/default")
}
fn one() -> usize {
    1
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            dir: default_dir(),
            log_interval: 1,
            peak_tflops: None,
            trace_step: None,
            tensorboard: false,
            straggler_factor: default_straggler_factor(),
            timing: StepTiming::default(),
        }
    }
}
