//! The on-disk records: the manifest, per-rank piece lists and tensor kinds.

use serde::{Deserialize, Serialize};

/// File name of the manifest inside a step directory.
pub const MANIFEST: &str = "manifest.json";
/// File name of the tokenizer copy inside a step directory.
pub const TOKENIZER: &str = "tokenizer.json";
/// Format identifier stored in every manifest.
pub const FORMAT: &str = "pretrain-checkpoint-v1";

/// Which optimizer tensor a piece holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// fp32 master weights (the parameters are these, cast to the training dtype).
    Master,
    /// AdamW first moment.
    ExpAvg,
    /// AdamW second moment.
    ExpAvgSq,
}

impl Kind {
    /// All kinds, in file order.
    pub const ALL: [Kind; 3] = [Kind::Master, Kind::ExpAvg, Kind::ExpAvgSq];

    /// Short name used in tensor keys.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Master => "master",
            Kind::ExpAvg => "exp_avg",
            Kind::ExpAvgSq => "exp_avg_sq",
        }
    }
}

/// A block of a named tensor, as ranks write and read them: the tensor's name and whole shape,
/// and where the block starts and how far it extends along each dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorBlock<'a> {
    /// Parameter name (Hugging Face naming).
    pub name: &'a str,
    /// Shape of the whole tensor.
    pub global_shape: &'a [usize],
    /// First index of the block along each dimension.
    pub offset: &'a [usize],
    /// Extent of the block along each dimension.
    pub shape: &'a [usize],
}

impl TensorBlock<'_> {
    /// `(offset, length)` per dimension, as stored in [`PieceMeta::block`].
    pub(crate) fn spans(&self) -> Vec<(usize, usize)> {
        self.offset
            .iter()
            .copied()
            .zip(self.shape.iter().copied())
            .collect()
    }
}

/// One piece: elements `range` (row-major) of the block `block` of tensor `name`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceMeta {
    /// Parameter name (Hugging Face naming).
    pub name: String,
    /// Tensor kind.
    pub kind: Kind,
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// `(offset, length)` per dimension of the block this piece is part of.
    pub block: Vec<(usize, usize)>,
    /// Element range `[start, end)` of the block, row-major.
    pub range: (usize, usize),
    /// Key of the data in the rank's safetensors file.
    pub key: String,
    /// The rank file holding it.
    pub file: String,
}

/// A shard file and its integrity data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the step directory.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Lower-case hex SHA-256 of the contents.
    pub sha256: String,
}

/// A rank's sidecar: its file and its pieces.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankRecord {
    /// The rank's shard file.
    pub file: FileEntry,
    /// The pieces it holds.
    pub pieces: Vec<PieceMeta>,
}

/// Everything needed to resume, reshard or export, written last.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Optimizer steps completed.
    pub step: u64,
    /// Global training samples consumed (the data loader's state).
    pub consumed_samples: u64,
    /// Seed of initialisation and data order.
    pub seed: u64,
    /// The model config (`model:` recipe section) as JSON.
    pub model: serde_json::Value,
    /// The whole resolved recipe (YAML text).
    pub recipe: String,
    /// Layout that wrote the checkpoint (`parallel:` recipe section) as JSON.
    pub layout: serde_json::Value,
    /// The training loop's own state beyond the optimizer (updates applied, skipped steps,
    /// recent losses), in the trainer's format; absent in older checkpoints.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub trainer: serde_json::Value,
    /// Shard files with sizes and checksums.
    pub files: Vec<FileEntry>,
    /// Every piece of every tensor.
    pub pieces: Vec<PieceMeta>,
}
