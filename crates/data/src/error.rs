//! Defines [`DataError`], the single error type of the data crate.
//!
//! Every variant that concerns a file names it; format errors also name the field and
//! give the expected and found values so a corrupt dataset can be diagnosed from the
//! message alone.

use std::path::PathBuf;

/// Everything that can go wrong in tokenizer training, preprocessing, dataset reading and loading.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An operating-system I/O error on a named file.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file being read or written.
        path: PathBuf,
        /// The underlying error (in the message, not repeated as a cause).
        error: std::io::Error,
    },
    /// The `.idx` file does not start with Megatron's magic bytes `MMIDIDX\0\0`.
    #[error("{}: bad magic: expected {expected:?}, found {found:?} (not a Megatron indexed dataset index)", path.display())]
    BadMagic {
        /// The `.idx` file.
        path: PathBuf,
        /// The magic bytes required by the format.
        expected: Vec<u8>,
        /// The bytes found at the start of the file.
        found: Vec<u8>,
    },
    /// The `.idx` version field is not 1.
    #[error("{}: field `version`: expected {expected}, found {found}", path.display())]
    BadVersion {
        /// The `.idx` file.
        path: PathBuf,
        /// The only supported version.
        expected: u64,
        /// The version stored in the file.
        found: u64,
    },
    /// The `.idx` dtype code is not one of Megatron's codes 1..=8.
    #[error("{}: field `dtype`: unknown dtype code {code} (expected 1..=8)", path.display())]
    UnknownDtype {
        /// The `.idx` file.
        path: PathBuf,
        /// The code found.
        code: u8,
    },
    /// The dtype is valid in Megatron's format but cannot hold token ids (a float type).
    #[error("{}: field `dtype`: {dtype} cannot hold token ids (expected an integer dtype)", path.display())]
    UnsupportedDtype {
        /// The `.idx` file.
        path: PathBuf,
        /// The dtype name.
        dtype: &'static str,
    },
    /// A file ended before a field could be read completely.
    #[error("{}: truncated at field `{field}`: need {expected} bytes, file has {found}", path.display())]
    Truncated {
        /// The truncated file.
        path: PathBuf,
        /// The field that could not be read.
        field: &'static str,
        /// The file length needed to read the field.
        expected: u64,
        /// The actual file length.
        found: u64,
    },
    /// Two parts of a dataset disagree with each other.
    #[error("{}: field `{field}`[{index}]: expected {expected}, found {found}", path.display())]
    Inconsistent {
        /// The file holding the inconsistent field.
        path: PathBuf,
        /// The field (e.g. `sequence_pointers`, `document_indices`).
        field: &'static str,
        /// The element index within the field.
        index: u64,
        /// The value implied by the other fields.
        expected: String,
        /// The value stored.
        found: String,
    },
    /// The `.bin` file is shorter than the sequence pointers and lengths require.
    #[error("{}: data file too short: pointers and lengths need {expected} bytes, file has {found}", path.display())]
    BinTruncated {
        /// The `.bin` file.
        path: PathBuf,
        /// Bytes required by the index.
        expected: u64,
        /// Actual file length.
        found: u64,
    },
    /// The dataset holds no sequences or no tokens.
    #[error("{}: empty dataset: {what}", path.display())]
    EmptyDataset {
        /// The `.idx` file (or the prefix).
        path: PathBuf,
        /// What is empty.
        what: String,
    },
    /// A stored token cannot be represented as a `u32` token id (negative or too large).
    #[error("{}: sequence {sequence}: token value {value} is not a valid token id", path.display())]
    BadToken {
        /// The `.bin` file.
        path: PathBuf,
        /// The sequence holding it.
        sequence: usize,
        /// The stored value.
        value: i64,
    },
    /// A tokenizer file could not be loaded, trained or used.
    #[error("tokenizer {}: {message}", path.display())]
    Tokenizer {
        /// The tokenizer file (or training output).
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// The tokenizer lacks the end-of-document token.
    #[error("tokenizer {}: has no end-of-document token (looked for `{token}`), needed by {needed_by}", path.display())]
    MissingEod {
        /// The tokenizer file.
        path: PathBuf,
        /// The tokens that were looked up.
        token: String,
        /// What needs it.
        needed_by: String,
    },
    /// A JSONL line is not valid JSON or lacks the text field.
    #[error("{}:{line}: {message}", path.display())]
    Jsonl {
        /// The `.jsonl` file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        message: String,
    },
    /// An input pattern matched nothing or an input has an unsupported extension.
    /// A damaged, truncated or refused input file, with where the problem was found (a byte
    /// offset, a row, a footer).
    #[error("{}: {at}: {message}", path.display())]
    Corrupt {
        path: PathBuf,
        at: String,
        message: String,
    },
    #[error("input `{input}`: {message}")]
    Input {
        /// The input path or glob as given.
        input: String,
        /// What is wrong.
        message: String,
    },
    /// A configuration or option value is invalid; `field` names it as the user wrote it.
    #[error("{field}: {message}")]
    Config {
        /// The option or recipe field (e.g. `data.split`).
        field: String,
        /// What is wrong and what is expected.
        message: String,
    },
    /// Preprocessing stopped by a signal (SIGINT, SIGTERM) before it was done.
    #[error("stopped by signal {signal} before the output was complete; nothing was written (an existing dataset of the prefix is kept)")]
    Stopped {
        /// The signal number.
        signal: i32,
    },
    /// A sample, sequence or token range outside what exists.
    #[error("{what} {index} out of range (have {len})")]
    OutOfRange {
        /// What was indexed (e.g. `sample`, `sequence`).
        what: &'static str,
        /// The requested index.
        index: u64,
        /// The number available.
        len: u64,
    },
}

impl DataError {
    /// Wraps an I/O error with the file it concerns.
    pub fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        DataError::Io {
            path: path.into(),
            error,
        }
    }

    /// A configuration error for `field`.
    /// A damaged or refused input `path`, at `at` (`byte 7`, `row 12`, `footer`).
    pub fn corrupt(
        path: impl Into<PathBuf>,
        at: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        DataError::Corrupt {
            path: path.into(),
            at: at.into(),
            message: message.into(),
        }
    }

    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        DataError::Config {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Result alias used throughout the crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;
