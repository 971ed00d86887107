//! The on-disk records: the manifest, per-rank piece lists and tensor kinds.

use half::bf16;
use serde::{Deserialize, Serialize};

/// File name of the manifest inside a step directory.
pub const MANIFEST: &str = "manifest.json";
/// File name of the tokenizer copy inside a step directory.
pub const TOKENIZER: &str = "tokenizer.json";
/// File name, in a checkpoint root, of the pointer to the newest complete step directory.
pub const LATEST: &str = "latest";
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
    /// Muon's momentum buffer (the hidden matrices of runs with `optimizer.name: muon`).
    Momentum,
}

impl Kind {
    /// All kinds, in file order.
    pub const ALL: [Kind; 4] = [Kind::Master, Kind::ExpAvg, Kind::ExpAvgSq, Kind::Momentum];
    /// The kinds of a tensor AdamW updates.
    pub const ADAMW: [Kind; 3] = [Kind::Master, Kind::ExpAvg, Kind::ExpAvgSq];
    /// The kinds of a tensor Muon updates.
    pub const MUON: [Kind; 2] = [Kind::Master, Kind::Momentum];

    /// Short name used in tensor keys.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Master => "master",
            Kind::ExpAvg => "exp_avg",
            Kind::ExpAvgSq => "exp_avg_sq",
            Kind::Momentum => "momentum",
        }
    }
}

/// The element type a piece is stored in: master weights always f32, moments f32 or bf16
/// (`optimizer.state_dtype`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PieceDtype {
    /// 32-bit floats (every piece of checkpoints that do not say).
    #[default]
    F32,
    /// bfloat16.
    Bf16,
}

impl PieceDtype {
    /// Its name, as manifests write it.
    pub fn as_str(self) -> &'static str {
        match self {
            PieceDtype::F32 => "f32",
            PieceDtype::Bf16 => "bf16",
        }
    }

    /// Bytes per value.
    pub fn width(self) -> usize {
        match self {
            PieceDtype::F32 => 4,
            PieceDtype::Bf16 => 2,
        }
    }
}

/// A piece's values in the type it is stored in.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values.
    Bf16(Vec<bf16>),
}

impl Values {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::Bf16(v) => v.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The type they are stored in.
    pub fn dtype(&self) -> PieceDtype {
        match self {
            Values::F32(_) => PieceDtype::F32,
            Values::Bf16(_) => PieceDtype::Bf16,
        }
    }

    /// Values `range` of these, in the same type.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Values {
        match self {
            Values::F32(v) => Values::F32(v[range].to_vec()),
            Values::Bf16(v) => Values::Bf16(v[range].to_vec()),
        }
    }

    /// The values as f32 (bf16 widens exactly).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Values::F32(v) => v.clone(),
            Values::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// The values in `dtype`: f32 to bf16 rounds to nearest (even), bf16 to f32 is exact.
    pub fn to_dtype(&self, dtype: PieceDtype) -> Values {
        match (self, dtype) {
            (Values::F32(v), PieceDtype::Bf16) => {
                Values::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect())
            }
            (Values::Bf16(_), PieceDtype::F32) => Values::F32(self.to_f32()),
            _ => self.clone(),
        }
    }

    /// Little-endian bytes, as safetensors stores them.
    pub(crate) fn le_bytes(&self) -> Vec<u8> {
        match self {
            Values::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Values::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

impl From<Vec<f32>> for Values {
    fn from(v: Vec<f32>) -> Self {
        Values::F32(v)
    }
}

impl From<Vec<bf16>> for Values {
    fn from(v: Vec<bf16>) -> Self {
        Values::Bf16(v)
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
    /// The type its values are stored in (f32 in checkpoints that do not say).
    #[serde(default)]
    pub dtype: PieceDtype,
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

/// A dataset the run trained on, as it was on disk: a resume compares it with the recipe's
/// dataset of the same prefix, so other data under the same path is not taken silently.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetEntry {
    /// The dataset's path prefix, as the recipe names it.
    pub prefix: String,
    /// Size of `<prefix>.bin` in bytes.
    pub bin_bytes: u64,
    /// Size of `<prefix>.idx` in bytes.
    pub idx_bytes: u64,
    /// Lower-case hex SHA-256 of `<prefix>.idx` (every document's length and offset).
    pub idx_sha256: String,
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
    /// The tokenizer copy ([`TOKENIZER`]) with its size and checksum; absent in older
    /// checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<FileEntry>,
    /// The datasets trained on; absent in older checkpoints and imports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub datasets: Vec<DatasetEntry>,
}
