//! Defines preprocessing ([`PreprocessOptions`], [`preprocess`], [`PreprocessSummary`]):
//! text/JSONL documents → tokenized Megatron indexed dataset `P.bin` + `P.idx`.
//!
//! Each document is tokenized without special tokens and followed by the tokenizer's
//! `<|endoftext|>` id; every document becomes one sequence. Files are read in sorted order;
//! documents are collected into batches of about 32 MB of text (across file boundaries) and
//! each batch is tokenized in parallel, then written in input order, so the output is
//! identical for any worker count. JSONL files are streamed; a text file is read whole.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;

use crate::documents::{expand_inputs, read_documents};
use crate::error::{DataError, Result};
use crate::indexed::{bin_path, idx_path, DType, IndexedDatasetWriter};
use crate::tokenizer::{eod_id, load_tokenizer};

/// Documents are tokenized in parallel batches of about this many bytes of text.
const BATCH_BYTES: usize = 32 << 20;

/// Options of [`preprocess`] (`pretrain preprocess`).
#[derive(Debug, Clone)]
pub struct PreprocessOptions {
    /// Input files or glob patterns (`.txt`/`.text` or `.jsonl`); matches are sorted.
    pub inputs: Vec<String>,
    /// The `tokenizer.json` to tokenize with; it must contain `<|endoftext|>`.
    pub tokenizer: PathBuf,
    /// Output prefix: writes `<prefix>.bin` and `<prefix>.idx`.
    pub output_prefix: PathBuf,
    /// JSONL field holding the document text (default `text`).
    pub json_key: String,
    /// For `.txt` inputs: split each file into documents at this string (e.g. `"\n\n\n"`);
    /// `None` makes each file one document.
    pub doc_separator: Option<String>,
    /// Tokenization threads; `None` uses all cores.
    pub workers: Option<usize>,
    /// Show a progress bar (only ever drawn when stderr is a terminal).
    pub show_progress: bool,
}

impl Default for PreprocessOptions {
    fn default() -> Self {
        PreprocessOptions {
            inputs: Vec::new(),
            tokenizer: PathBuf::from("tokenizer.json"),
            output_prefix: PathBuf::from("dataset"),
            json_key: "text".into(),
            doc_separator: None,
            workers: None,
            show_progress: true,
        }
    }
}

/// What [`preprocess`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessSummary {
    /// Input files read.
    pub files: usize,
    /// Documents (= sequences) written.
    pub documents: u64,
    /// Tokens written, including one EOD per document.
    pub tokens: u64,
    /// Bytes of input text read.
    pub input_bytes: u64,
    /// Bytes of the `.bin` file.
    pub output_bytes: u64,
    /// Token dtype of the `.bin` file.
    pub dtype: DType,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// Input throughput in MB/s (10^6 bytes).
    pub mb_per_s: f64,
    /// The `.bin` written.
    pub bin: PathBuf,
    /// The `.idx` written.
    pub idx: PathBuf,
}

impl std::fmt::Display for PreprocessSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} files, {} documents, {} tokens ({}), {:.2} MB in, {:.2} MB out, {:.1} s, {:.2} MB/s -> {} + {}",
            self.files,
            self.documents,
            self.tokens,
            self.dtype.name(),
            self.input_bytes as f64 / 1e6,
            self.output_bytes as f64 / 1e6,
            self.seconds,
            self.mb_per_s,
            self.bin.display(),
            self.idx.display()
        )
    }
}

/// Tokenizes the inputs and writes a Megatron indexed dataset; see the module docs.
pub fn preprocess(opts: &PreprocessOptions) -> Result<PreprocessSummary> {
    let start = Instant::now();
    if opts.json_key.is_empty() {
        return Err(DataError::config("json_key", "must not be empty"));
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match opts.workers {
        Some(0) => return Err(DataError::config("workers", "must be at least 1")),
        Some(n) if n > 4 * cores => {
            return Err(DataError::config(
                "workers",
                format!("{n} is more than 4 × the {cores} cores of this machine"),
            ))
        }
        _ => {}
    }
    let files = expand_inputs(&opts.inputs)?;
    let tokenizer = load_tokenizer(&opts.tokenizer)?;
    let eod = eod_id(&tokenizer, &opts.tokenizer)?;
    let dtype = DType::for_vocab_size(tokenizer.get_vocab_size(true));

    let mut total_bytes = 0u64;
    for f in &files {
        total_bytes += std::fs::metadata(f).map_err(|e| DataError::io(f, e))?.len();
    }
    let bar = if opts.show_progress && std::io::stderr().is_terminal() {
        let bar = ProgressBar::new(total_bytes);
        if let Ok(style) = ProgressStyle::with_template(
            "[{elapsed_precise}] {msg} {wide_bar} {bytes}/{total_bytes} ({bytes_per_sec})",
        ) {
            bar.set_style(style);
        }
        bar.set_message("tokenizing");
        bar
    } else {
        ProgressBar::hidden()
    };

    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(n) = opts.workers {
        builder = builder.num_threads(n);
    }
    let pool = builder
        .build()
        .map_err(|e| DataError::config("workers", format!("cannot start thread pool: {e}")))?;

    let mut writer = IndexedDatasetWriter::create(&opts.output_prefix, dtype)?;
    let (mut documents, mut tokens) = (0u64, 0u64);
    let mut pending: Vec<(usize, String)> = Vec::new();
    let mut pending_bytes = 0usize;
    let mut flush = |pending: &mut Vec<(usize, String)>, bytes: &mut usize| -> Result<()> {
        let encoded = pool.install(|| {
            pending
                .par_iter()
                .map(|(f, doc)| encode(&tokenizer, doc, eod, &files[*f], &opts.tokenizer))
                .collect::<Result<Vec<Vec<u32>>>>()
        })?;
        for ids in &encoded {
            writer.add_document(ids)?;
            tokens += ids.len() as u64;
        }
        documents += encoded.len() as u64;
        bar.inc(*bytes as u64);
        pending.clear();
        *bytes = 0;
        Ok(())
    };
    for (f, file) in files.iter().enumerate() {
        for doc in read_documents(file, &opts.json_key, opts.doc_separator.as_deref())? {
            let doc = doc?;
            pending_bytes += doc.len();
            pending.push((f, doc));
            if pending_bytes >= BATCH_BYTES {
                flush(&mut pending, &mut pending_bytes)?;
            }
        }
    }
    flush(&mut pending, &mut pending_bytes)?;
    if documents == 0 {
        drop(writer); // removes its temporary file; an existing dataset stays
        return Err(DataError::EmptyDataset {
            path: opts.output_prefix.clone(),
            what: "the inputs contain no documents".into(),
        });
    }
    let output_bytes = writer.finish()?;
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    Ok(PreprocessSummary {
        files: files.len(),
        documents,
        tokens,
        input_bytes: total_bytes,
        output_bytes,
        dtype,
        seconds,
        mb_per_s: total_bytes as f64 / 1e6 / seconds.max(1e-9),
        bin: bin_path(&opts.output_prefix),
        idx: idx_path(&opts.output_prefix),
    })
}

/// Token ids of one document followed by the EOD id; errors name the input file.
fn encode(
    tokenizer: &tokenizers::Tokenizer,
    doc: &str,
    eod: u32,
    file: &std::path::Path,
    tokenizer_path: &std::path::Path,
) -> Result<Vec<u32>> {
    let mut ids =
        crate::tokenizer::encode_long(tokenizer, doc).map_err(|e| DataError::Tokenizer {
            path: tokenizer_path.to_path_buf(),
            message: format!("encoding a document of {} failed: {e}", file.display()),
        })?;
    ids.push(eod);
    Ok(ids)
}
