//! `ParallelConfig`: the `parallel:` section of a recipe (how ranks split the work).

use serde::{Deserialize, Serialize};

use crate::dp::ZeroStage;
use crate::pipeline::ScheduleKind;

/// Degrees of data, tensor, context and pipeline parallelism and their options.
/// The world size is `dp × tp × cp × pp`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelConfig {
    /// Data-parallel replicas: each sees its slice of every global batch.
    #[serde(default = "one")]
    pub dp: usize,
    /// Tensor-parallel ranks: each holds a slice of every layer's matrices.
    #[serde(default = "one")]
    pub tp: usize,
    /// Context-parallel ranks: each holds `1 / cp` of every sequence (two chunks of `2·cp`, for
    /// equal causal work) and attention runs as a ring that passes K/V blocks among them.
    #[serde(default = "one")]
    pub cp: usize,
    /// Pipeline stages: each holds a contiguous range of layers.
    #[serde(default = "one")]
    pub pp: usize,
    /// Expert-parallel ranks: each holds `1 / ep` of every mixture-of-experts layer's experts,
    /// and tokens travel to their experts' ranks by all-to-all. Folded inside data parallelism
    /// (it must divide `dp`): the `ep` consecutive data-parallel ranks of an expert-parallel group
    /// read different samples and share their experts (see `mesh.rs`).
    #[serde(default = "one")]
    pub ep: usize,
    /// Model chunks per pipeline rank (interleaved 1F1B when greater than 1).
    #[serde(default = "one")]
    pub virtual_stages: usize,
    /// Layers of each pipeline chunk, in global chunk order (`pp × virtual_stages` entries, the
    /// model's order: with interleaving stage 0's first chunk, stage 1's, …, then each stage's
    /// second chunk; with zbv's V stage 0, 1, …, pp − 1, then back from pp − 1 to 0): uneven
    /// stages, e.g.
    /// `[3, 5, 5, 3]` to make room for the embedding on the first and the head on the last
    /// (those two chunks may hold no layer; every other one at least one). Default: an equal
    /// share, `num_hidden_layers / (pp × virtual_stages)` each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_layout: Option<Vec<usize>>,
    /// The pipeline schedule: `1f1b`, `interleaved` (needs `virtual_stages > 1`), `zb-h1`
    /// (zero-bubble: split backwards, their weight gradients filling 1F1B's cool-down), `zbv`
    /// (zero-bubble V: `virtual_stages: 2`, the chunks placed down and back up the stages) or
    /// `gpipe`. Default: `interleaved` with virtual stages, else `1f1b`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<ScheduleKind>,
    /// Split norms and residual activations along the sequence across tensor-parallel ranks.
    #[serde(default)]
    pub sequence_parallel: bool,
    /// ZeRO stage (Rajbhandari et al. 2020): what data-parallel ranks shard instead of
    /// replicating. 0: nothing; 1: optimizer state (fp32 master weights and moments); 2: also
    /// gradients (reduce-scattered after each micro-batch's backward of a unit); 3: also
    /// parameters (a unit is all-gathered before its forward and backward). See [`ZeroStage`].
    #[serde(default)]
    pub zero: ZeroStage,
    /// Hybrid sharding (HSDP): ZeRO shards within groups of this many data-parallel (× context-
    /// parallel) ranks and
    /// replicates across the groups (gradients reduce-scattered inside a group, then all-reduced
    /// across groups). Default: all data-parallel ranks form one group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero_shard_size: Option<usize>,
    /// The key before `zero`: still read so that recipes using it get an error naming the new
    /// key; never written.
    #[serde(default, skip_serializing)]
    pub zero1: Option<bool>,
    /// Elements per data-parallel gradient bucket: consecutive parameters are grouped until a
    /// bucket holds at least this many, and a bucket is reduced across data-parallel ranks as soon
    /// as all its gradients are final, while the backward pass goes on. Smaller buckets start
    /// communicating earlier; larger ones make fewer, bigger transfers.
    #[serde(default = "default_bucket_size")]
    pub bucket_size: usize,
    /// Seconds any communication may wait for its peers before failing with an error that names
    /// the missing ranks. On NCCL a stream-ordered operation's clock starts when it is queued,
    /// so this must also exceed the GPU time queued ahead of it (at most a step's work).
    #[serde(default = "default_timeout")]
    pub timeout_s: f64,
}

/// Default [`ParallelConfig::bucket_size`]: 4 Mi elements (16 MiB of fp32 gradients).
pub const DEFAULT_BUCKET_SIZE: usize = 1 << 22;

/// Most [`ParallelConfig::bucket_size`]: 1 Gi elements. A bucket (this many elements, plus at
/// most one parameter) is cast, added and copied whole by candle's CUDA kernels, whose 32-bit
/// index covers 2^31 elements.
pub const MAX_BUCKET_SIZE: usize = 1 << 30;

fn default_bucket_size() -> usize {
    DEFAULT_BUCKET_SIZE
}

fn default_timeout() -> f64 {
    300.0
}

fn one() -> usize {
    1
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            dp: 1,
            tp: 1,
            cp: 1,
            pp: 1,
            ep: 1,
            virtual_stages: 1,
            pipeline_layout: None,
            schedule: None,
            sequence_parallel: false,
            zero: ZeroStage::Off,
            zero_shard_size: None,
            zero1: None,
            bucket_size: DEFAULT_BUCKET_SIZE,
            timeout_s: default_timeout(),
        }
    }
}

impl ParallelConfig {
    /// The pipeline schedule steps run: `parallel.schedule`, or by default interleaved 1F1B with
    /// virtual stages, else 1F1B.
    pub fn schedule_kind(&self) -> ScheduleKind {
        self.schedule
            .unwrap_or_else(|| ScheduleKind::for_virtual_stages(self.virtual_stages))
    }

    /// Layers of each global pipeline chunk for a model of `num_layers`: the layout given (when
    /// it has one entry per chunk; validation refuses one that has not), or an equal share each.
    pub fn chunk_layers(&self, num_layers: usize) -> Vec<usize> {
        let layout = self.pipeline_layout.as_deref();
        chunk_layers(layout, self.pp * self.virtual_stages, num_layers)
    }

    /// The layout in one line, each parallelism's part as it registers it
    /// (`crate::register::Parallelism::describe`): `dp=2 +zero1 tp=2 +sp cp=1 pp=2 (virtual 2) ep=2`.
    pub fn describe(&self) -> String {
        let parts = crate::register::ALL.map(|p| p.describe(self));
        parts
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Number of ranks the layout needs.
    pub fn world_size(&self) -> usize {
        self.dp * self.tp * self.cp * self.pp
    }

    /// Ranks that hold the same weights and reduce their gradients together: `dp × cp` (the
    /// context-parallel ranks of a replica compute gradients from different tokens).
    pub fn grad_ranks(&self) -> usize {
        self.dp * self.cp
    }

    /// Ranks that hold the same experts and reduce their gradients together: the gradient ranks
    /// with the same expert-parallel index (`dp / ep × cp`).
    pub fn expert_grad_ranks(&self) -> usize {
        self.grad_ranks() / self.ep.max(1)
    }

    /// Ranks per ZeRO shard group (among the [`ParallelConfig::grad_ranks`]):
    /// `zero_shard_size`, or all of them; 1 at stage 0.
    pub fn shard_size(&self) -> usize {
        if !self.zero.shards_optimizer() {
            1
        } else {
            self.zero_shard_size.unwrap_or(self.grad_ranks())
        }
    }
}

/// Layers of each of `chunks` pipeline chunks for a model of `num_layers`: `layout` when it has
/// one entry per chunk, else an equal share each (see [`ParallelConfig::pipeline_layout`]).
pub fn chunk_layers(layout: Option<&[usize]>, chunks: usize, num_layers: usize) -> Vec<usize> {
    let chunks = chunks.max(1);
    match layout {
        Some(l) if l.len() == chunks => l.to_vec(),
        _ => vec![num_layers / chunks; chunks],
    }
}
