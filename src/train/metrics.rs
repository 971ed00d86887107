//! Run outputs: one JSON line per step and per validation in `metrics.jsonl` (and, with
//! `run.tensorboard`, the same scalars as TensorBoard events), the loss-curve plot
//! `loss.svg`, a step's timeline as a Perfetto trace with the measured pipeline bubble
//! ([`write_trace`]), and process memory readings.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use parallel::pipeline::{chrome_trace, Schedule, TraceSpan};
use parallel::{Group, ReduceOp};
use serde::Serialize;

use super::pipeline::Timed;
use super::RankCtx;
pub use parallel::dp::StateBytes;

/// What one optimizer step measured: one line of `metrics.jsonl`, its groups flattened into it.
#[derive(Debug, Clone, Serialize)]
pub struct StepRecord {
    /// 1-based step number.
    pub step: usize,
    /// Mean next-token loss over the global batch's counted tokens.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// How fast the step ran.
    #[serde(flatten)]
    pub rate: StepRate,
    /// What the step held in memory.
    #[serde(flatten)]
    pub memory: StepMemory,
    /// Where the step's time went.
    #[serde(flatten)]
    pub time: StepTimes,
    /// Mixture of experts: the router losses and how evenly each MoE layer spread its tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<super::routing::StepRouting>,
    /// Global samples consumed after this step.
    pub consumed_samples: u64,
    /// Why the step's update was discarded (`train.on_nonfinite: skip`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    /// On logged steps: the ranks' compute times and the stragglers among them
    /// (`compute_median_s`, `compute_max_s`, `stragglers`).
    #[serde(flatten)]
    pub compute: Option<super::stragglers::ComputeSpread>,
}

/// A step's throughput.
#[derive(Debug, Clone, Serialize)]
pub struct StepRate {
    /// Training throughput over all ranks.
    pub tokens_per_s: f64,
    /// Achieved model TFLOP/s per rank (the job's over its ranks; see
    /// `LlamaConfig::flops_per_token`; with documents kept apart by the attention mask, the
    /// attention work the mask leaves).
    pub tflops: f64,
    /// With `data.reset_attention_mask`: the share of the causal attention pairs the step
    /// computed (the document mask keeps the rest out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention_share: Option<f64>,
    /// Model FLOPs utilisation, when the device peak is known: of [`StepRate::tflops`] (causal
    /// attention counted once, the work a causal kernel does).
    pub mfu: Option<f64>,
    /// The same in the count most published tables use (PaLM's `6N + 12 L s q` per token:
    /// attention counted over every (query, key) pair, as if the mask were full).
    pub mfu_full_attention: Option<f64>,
}

/// A step's memory: the process's, the device's and this rank's training state and peaks.
#[derive(Debug, Clone, Serialize)]
pub struct StepMemory {
    /// Peak resident memory of the process, MiB.
    pub mem_mib: f64,
    /// On a GPU: device memory this process had allocated at the end of the step, MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_mem_mib: Option<f64>,
    /// On a GPU: the most device memory this process had allocated at once during the step, MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_peak_mib: Option<f64>,
    /// On a GPU: the device memory this process's memory pool holds, MiB (the most it ever had
    /// in use at once, start-up included: the pool keeps freed memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_pool_mib: Option<f64>,
    /// On a GPU: device memory in use beyond what the pool holds at the step's end (context,
    /// kernels, library workspaces, NCCL's buffers; other processes' on a shared GPU), MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_outside_pool_mib: Option<f64>,
    /// This rank's persistent training state, from buffer sizes.
    #[serde(flatten)]
    pub state: StateBytes,
    /// Peak bytes of activations this rank kept for backward passes during the step (distinct
    /// storages of the pieces' tapes, or their inputs under recompute, plus a recomputing
    /// backward's rebuilt tape; see `train/pipeline.rs`).
    pub act_peak_bytes: usize,
    /// Tensors carrying an autograd graph among what this rank's step kept, handed on and
    /// returned (`StepRun::tracked`): the pieces build none, so this is zero; not written.
    #[serde(skip)]
    pub graph_tensors: usize,
    /// Peak bytes of gathered full parameters live at once during the step (ZeRO-3: the pieces
    /// being computed and the next piece's, gathered ahead).
    pub param_unit_peak_bytes: usize,
    /// Peak bytes of staged full-size gradients during the step (ZeRO-2/3): the most the buckets
    /// being accumulated held at once plus the most the reduce-scatters queued or running on the
    /// communication thread held at once (an upper bound of their sum at any instant).
    pub grad_unit_peak_bytes: usize,
    /// The most activation bytes any rank kept during the traced step (the largest
    /// `act_peak_bytes` over the ranks; with pipelines, usually the first stage's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub act_peak_max_bytes: Option<usize>,
}

/// A step's time and the shares of its communication hidden behind compute.
#[derive(Debug, Clone, Serialize)]
pub struct StepTimes {
    /// Wall time of the step, seconds.
    pub step_time_s: f64,
    /// Seconds of the optimizer update (with Muon, its matrix exchange and iterations) and the
    /// parameters made from it; 0 when the update was skipped. On a GPU timed on logged steps
    /// only (the device is waited for there), else the host's share.
    pub optimizer_s: f64,
    /// ZeRO-3: seconds the parameter all-gathers took on the communication thread.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gather_s: Option<f64>,
    /// ZeRO-3: the share of that time hidden behind compute (1 − time the compute thread
    /// waited for a gather / gather time).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gather_hidden: Option<f64>,
    /// Context parallelism on the CPU: seconds this rank spent in ring attention (compute and
    /// communication, forward, backward and recompute). Not written on CUDA, where the calls
    /// return once queued (a traced step, `run.trace_step`, times them on the device).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ring_s: Option<f64>,
    /// Of which the seconds the rank spent handing K/V blocks to the backend and waiting for its
    /// neighbour's: the transfer time not hidden behind the blocks' compute (CPU only, as
    /// `ring_s`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ring_exposed_s: Option<f64>,
    /// Measured pipeline bubble fraction, on the step whose timeline was traced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bubble: Option<f64>,
    /// The bubble fraction the schedule has in the simulator on the traced step's measured
    /// costs (each kind of action's mean over the ranks): the schedule's own idle time, apart
    /// from ranks slowing each other (CPU threads sharing cores) or from communication.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bubble_simulated: Option<f64>,
    /// Share of the data-parallel gradient buckets reduced before the rank's schedule ended
    /// (overlapped with its backward passes), on the traced step (with data parallelism).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_overlap: Option<f64>,
    /// Seconds the traced step waited after the schedule for the rest of the gradient sync.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_exposed_s: Option<f64>,
}

/// A validation result.
#[derive(Debug, Clone, Serialize)]
pub struct EvalRecord {
    /// Step after which validation ran.
    pub step: usize,
    /// Mean validation loss.
    pub val_loss: f64,
}

/// Appends records to `metrics.jsonl` and keeps the curves for the plot.
pub struct Metrics {
    out: BufWriter<File>,
    tensorboard: Option<super::tensorboard::EventWriter>,
    dir: PathBuf,
    train: Vec<(usize, f64)>,
    valid: Vec<(usize, f64)>,
}

impl Metrics {
    /// Opens `dir/metrics.jsonl` for a run that starts after step `start` (0 for a fresh run):
    /// the records of steps up to `start` are kept (and plotted), later ones (steps a resumed
    /// run will redo, or an earlier run's) are removed, so the file holds each step once. With
    /// `tensorboard`, a new event file is started beside it.
    pub fn open(dir: &Path, start: usize, tensorboard: bool) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating run directory {}", dir.display()))?;
        let path = dir.join("metrics.jsonl");
        let (mut train, mut valid) = (vec![], vec![]);
        if path.exists() {
            // Opened as it is appended to: never through a link, never blocking on a FIFO.
            let mut text = String::new();
            crate::files::open_regular(&path, File::options().read(true), "the metrics log")?
                .read_to_string(&mut text)
                .with_context(|| format!("reading {}", path.display()))?;
            let mut kept = String::new();
            let mut dropped = 0usize;
            for line in text.lines() {
                let v: Option<serde_json::Value> = serde_json::from_str(line).ok();
                let step = v.as_ref().and_then(|v| v["step"].as_u64());
                match step {
                    Some(s) if s as usize <= start => {
                        let v = v.as_ref().expect("parsed");
                        if let Some(l) = v["loss"].as_f64() {
                            train.push((s as usize, l));
                        }
                        if let Some(l) = v["val_loss"].as_f64() {
                            valid.push((s as usize, l));
                        }
                        kept.push_str(line);
                        kept.push('\n');
                    }
                    _ => dropped += 1,
                }
            }
            if dropped > 0 {
                tracing::warn!(
                    "{}: removed {dropped} record(s) after step {start}, which this run (re)does",
                    path.display()
                );
                crate::files::write_replacing(&path, kept.as_bytes())?;
            }
        }
        let mut options = File::options();
        options.create(true).append(true);
        let f = crate::files::open_regular(&path, &mut options, "the metrics log")?;
        let tensorboard = tensorboard
            .then(|| super::tensorboard::EventWriter::create(dir, start))
            .transpose()?;
        Ok(Self {
            out: BufWriter::new(f),
            tensorboard,
            dir: dir.to_path_buf(),
            train,
            valid,
        })
    }

    /// Records a step.
    pub fn step(&mut self, r: &StepRecord) -> Result<()> {
        // A step without a loss target has none to plot (NaN, `null` in the record).
        if r.loss.is_finite() {
            self.train.push((r.step, r.loss));
        }
        if let Some(tb) = &mut self.tensorboard {
            let mut all: Vec<(String, f64)> = (scalars(r).into_iter())
                .map(|(t, x)| (t.to_string(), x))
                .collect();
            all.extend(r.moe.as_ref().map_or(Vec::new(), super::routing::scalars));
            let tags: Vec<(&str, f64)> = all.iter().map(|(t, x)| (t.as_str(), *x)).collect();
            tb.scalars(r.step, &tags)?;
        }
        self.line(r)
    }

    /// Records a validation.
    pub fn eval(&mut self, r: &EvalRecord) -> Result<()> {
        if r.val_loss.is_finite() {
            self.valid.push((r.step, r.val_loss));
        }
        if let Some(tb) = &mut self.tensorboard {
            tb.scalars(r.step, &[("valid/loss", r.val_loss)])?;
        }
        self.line(r)
    }

    fn line<T: Serialize>(&mut self, r: &T) -> Result<()> {
        let mut line = serde_json::to_vec(r)?;
        line.push(b'\n');
        self.out
            .write_all(&line)
            .and_then(|_| self.out.flush())
            .with_context(|| format!("writing {}", self.dir.join("metrics.jsonl").display()))
    }

    /// Writes `loss.svg` with the training and validation curves.
    pub fn plot(&self) -> Result<()> {
        let path = self.dir.join("loss.svg");
        crate::files::write_replacing(
            &path,
            super::plot::loss_svg(&self.train, &self.valid).as_bytes(),
        )
    }
}

/// The TensorBoard scalars of a step: its loss, rates and memory.
fn scalars(r: &StepRecord) -> Vec<(&'static str, f64)> {
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    let mut v = vec![
        ("train/loss", r.loss),
        ("train/lr", r.lr),
        ("train/grad_norm", r.grad_norm),
        ("throughput/tokens_per_s", r.rate.tokens_per_s),
        ("throughput/tflops", r.rate.tflops),
        ("throughput/step_time_s", r.time.step_time_s),
        ("memory/process_peak_mib", r.memory.mem_mib),
        ("memory/state_mib", mib(r.memory.state.total())),
        ("memory/activations_peak_mib", mib(r.memory.act_peak_bytes)),
    ];
    let optional = [
        ("throughput/mfu", r.rate.mfu),
        ("throughput/mfu_full_attention", r.rate.mfu_full_attention),
        ("memory/device_mib", r.memory.device_mem_mib),
        ("memory/device_peak_mib", r.memory.device_peak_mib),
        ("memory/device_pool_mib", r.memory.device_pool_mib),
        (
            "memory/device_outside_pool_mib",
            r.memory.device_outside_pool_mib,
        ),
    ];
    v.extend(optional.into_iter().filter_map(|(t, x)| x.map(|x| (t, x))));
    v
}

/// Peak resident set size of this process in MiB (Linux `VmHWM`; 0 where unavailable).
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|kb| kb.parse::<f64>().ok())
            })
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// What a traced step measured (rank 0; means over all ranks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceSummary {
    /// Idle share of the schedule phase (the pipeline bubble).
    pub bubble: f64,
    /// Share of the data-parallel gradient buckets whose reduction ended before the rank's
    /// schedule did, i.e. overlapped with its backward passes (`None` without data parallelism).
    pub sync_overlap: Option<f64>,
    /// Seconds from the end of a rank's schedule to the end of its last bucket reduction: the
    /// gradient sync the step waits for (`None` without data parallelism).
    pub sync_exposed_s: Option<f64>,
    /// The largest peak of activation bytes over the ranks.
    pub act_peak_max_bytes: usize,
}

/// Writes a step's timeline as a Chrome/Perfetto trace to `path`: every rank's timed actions
/// (`timing`, this rank's), its optimizer span `(start, end)` and the data-parallel reductions of
/// its gradient buckets (`sync`: bucket and seconds since the step began) on a row of their own,
/// gathered from all ranks with each rank's peak activation bytes (`act_peak`). Returns the
/// measured bubble, gradient-sync overlap and largest activation peak on rank 0, `None`
/// elsewhere (every rank takes part).
pub fn write_trace(
    ctx: &RankCtx,
    schedule: &Schedule,
    (timing, act_peak): (&[Timed], usize),
    optimizer: (f64, f64),
    sync: &[(usize, Range<f64>)],
    path: &Path,
) -> Result<Option<TraceSummary>> {
    let everyone = Group::new((0..ctx.mesh.world_size()).collect());
    let gather = |mut row: Vec<f64>, width: usize| -> Result<Vec<Vec<f64>>> {
        row.resize(width, f64::NAN);
        let t = Tensor::from_vec(row, (1, width), &Device::Cpu)?;
        Ok(ctx.comm.all_gather(&everyone, &t, 0)?.to_vec2::<f64>()?) // [world, width]
    };
    // The activation peak, then actions and the optimizer: one row per rank, padded to the
    // longest action list.
    let mine: Vec<f64> = std::iter::once(act_peak as f64)
        .chain(timing.iter().flat_map(|t| [t.start, t.end]))
        .chain([optimizer.0, optimizer.1])
        .collect();
    let width = 2 * schedule.actions.iter().map(Vec::len).max().unwrap_or(0) + 3;
    let mut steps = gather(mine, width)?;
    let act_peak_max = steps
        .iter_mut()
        .map(|row| row.remove(0))
        .fold(0.0, f64::max);
    // Bucket reductions: as many as the rank with the most buckets.
    let most = ctx.comm.all_reduce(
        &everyone,
        &Tensor::new(&[sync.len() as f64], &Device::Cpu)?,
        ReduceOp::Max,
    )?;
    let most = most.to_vec1::<f64>()?[0] as usize;
    let syncs = gather(
        sync.iter()
            .flat_map(|(b, r)| [*b as f64, r.start, r.end])
            .collect(),
        3 * most.max(1),
    )?;
    if !ctx.is_main() {
        return Ok(None);
    }
    let world = steps.len();
    let (mut spans, mut bubbles) = (Vec::new(), Vec::new());
    let (mut buckets, mut hidden, mut exposed) = (0usize, 0usize, 0.0);
    for (rank, (times, reductions)) in steps.iter().zip(&syncs).enumerate() {
        let actions = &schedule.actions[ctx.mesh.coords(rank).pp];
        let (mut busy, mut window) = (0.0, 0.0f64);
        let mut span = |track: usize, name: String, s: f64, e: f64| {
            spans.push(TraceSpan {
                track,
                name,
                start_us: s * 1e6,
                dur_us: (e - s) * 1e6,
            })
        };
        for (k, a) in actions.iter().enumerate() {
            let (s, e) = (times[2 * k], times[2 * k + 1]);
            if a.is_compute() {
                busy += e - s;
            }
            window = window.max(e);
            span(rank, a.to_string(), s, e);
        }
        let (s, e) = (times[2 * actions.len()], times[2 * actions.len() + 1]);
        span(rank, "optimizer".into(), s, e);
        bubbles.push(1.0 - busy / window.max(1e-12));
        let mut last = window;
        for r in reductions.chunks_exact(3) {
            let (b, s, e) = (r[0], r[1], r[2]);
            if b.is_nan() {
                break;
            }
            span(world + rank, format!("dp reduce bucket {b}"), s, e);
            buckets += 1;
            hidden += usize::from(e <= window);
            last = last.max(e);
        }
        exposed += last - window;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let name = |track: usize| match track {
        t if t < world => format!("rank {t}"),
        t => format!("rank {} dp sync", t - world),
    };
    // Replaced by rename, as the run's other outputs: a FIFO or link planted there is not
    // written through.
    crate::files::write_replacing(path, chrome_trace(&spans, &name).as_bytes())?;
    Ok(Some(TraceSummary {
        bubble: bubbles.iter().sum::<f64>() / world as f64,
        sync_overlap: (buckets > 0).then(|| hidden as f64 / buckets as f64),
        sync_exposed_s: (buckets > 0).then(|| exposed / world as f64),
        act_peak_max_bytes: act_peak_max as usize,
    }))
}
