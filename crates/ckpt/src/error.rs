//! `CkptError`: every way reading or writing a checkpoint fails, naming the file involved.

use std::path::PathBuf;

/// A checkpoint problem.
#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    /// Reading or writing a file failed.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        /// The operating system's error (in the message, not repeated as a cause).
        error: std::io::Error,
    },
    /// The step directory has no manifest: it was never completed (e.g. the run died while saving).
    #[error("{dir}: incomplete checkpoint (no {file})")]
    Incomplete { dir: PathBuf, file: &'static str },
    /// The step directory does not exist (or is not a directory).
    #[error("{dir}: no such checkpoint directory")]
    NoCheckpoint { dir: PathBuf },
    /// A file listed in the manifest is missing.
    #[error("{path}: missing shard file listed in the manifest")]
    MissingFile { path: PathBuf },
    /// A file's size or checksum differs from the manifest.
    #[error("{path}: {what} mismatch (manifest {expected}, file {found})")]
    Corrupt {
        path: PathBuf,
        what: &'static str,
        expected: String,
        found: String,
    },
    /// A file's contents cannot be parsed.
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    /// A tensor is not (fully) present, or does not fit what the caller expects.
    #[error("{dir}: {message}")]
    Mismatch { dir: PathBuf, message: String },
}

impl CkptError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> CkptError {
        let path = path.into();
        move |error| CkptError::Io { path, error }
    }
}
