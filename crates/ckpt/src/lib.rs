//! Sharded, layout-free checkpoints.
//!
//! A checkpoint is a step directory written by every rank at once:
//!
//! ```text
//! <root>/step-00000100/
//!     rank-00000.safetensors   this rank's pieces of the optimizer state (f32; moments f32 or bf16)
//!     rank-00000.json          what those pieces are (names, global coordinates) and the file's sha256
//!     ...
//!     tokenizer.json           the tokenizer the run was trained with
//!     manifest.json            written last: step, samples consumed, seed, recipe, layout, files + checksums
//! <root>/latest                the name of the newest complete step directory
//! ```
//!
//! A *piece* is a contiguous run of elements of one tensor kind (master weights, first or second
//! moments) of one parameter: the parameter's tensor-parallel block (offset and length per
//! dimension of the whole tensor) and an element range of that block in row-major order, which is
//! what a ZeRO-1 shard cuts out of it. Pieces carry global coordinates, so a checkpoint written at
//! any data × tensor × pipeline layout is read back at any other one.
//!
//! The step directory is assembled under `step-N.tmp` and renamed into place after the manifest is
//! on disk; `latest` is replaced by rename. A directory without a valid manifest is never a
//! checkpoint.

mod error;
mod format;
mod read;
pub mod stream;
mod write;

pub use error::CkptError;
pub use format::{
    DatasetEntry, FileEntry, Kind, Manifest, PieceDtype, PieceMeta, TensorBlock, Values, LATEST,
    MANIFEST, TOKENIZER,
};
pub use read::{checkpoint_entry, find_latest, saved_steps, Checkpoint};
pub use write::{finalize, prune, sha256_hex, step_dir_name, tmp_dir, RankWriter, SourceError};

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, CkptError>;
