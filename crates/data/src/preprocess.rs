//! Defines preprocessing ([`PreprocessOptions`], [`preprocess`], [`PreprocessSummary`]):
//! text, JSONL and Parquet documents, plain or compressed ([`crate::input`]) → tokenized
//! Megatron indexed datasets `P.bin` + `P.idx`.
//!
//! Each document is tokenized without special tokens, optionally preceded by the tokenizer's
//! beginning-of-document id (`add_bos`, as Llama 3 pretrains) and followed by its
//! end-of-document id (`append_eod`, on by default); every document becomes one sequence. Files
//! are read in sorted order; documents are collected into batches of about 32 MB of text
//! (across file boundaries) and each batch is tokenized in parallel, then written in input
//! order, so the output is identical for any worker count and for any form the same documents
//! come in. With `shard_bytes`, a new `P_00001.bin/.idx` pair starts whenever a `.bin` reaches
//! that size (documents stay whole). Nothing is renamed into place before every input has been
//! read: a failed run leaves an existing dataset of the same prefix as it was.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;

use crate::error::{DataError, Result};
use crate::indexed::{bin_path, commit_all, idx_path, DType, IndexedDatasetWriter, SealedDataset};
use crate::input::{expand_inputs, read_documents};
use crate::tokenizer::{bos_id, eod_id, load_tokenizer};

/// Documents are tokenized in parallel batches of about this many bytes of text.
const BATCH_BYTES: usize = 32 << 20;

/// Options of [`preprocess`] (`pretrain preprocess`).
#[derive(Debug, Clone)]
pub struct PreprocessOptions {
    /// Input files or glob patterns (see [`crate::input`] for the forms); matches are sorted.
    pub inputs: Vec<String>,
    /// The `tokenizer.json` to tokenize with.
    pub tokenizer: PathBuf,
    /// Output prefix: writes `<prefix>.bin` and `<prefix>.idx` (or shards, see `shard_bytes`).
    pub output_prefix: PathBuf,
    /// JSONL field or Parquet column holding the document text (default `text`).
    pub json_key: String,
    /// For `.txt` inputs: split each file into documents at this string (e.g. `"\n\n\n"`);
    /// `None` makes each file one document.
    pub doc_separator: Option<String>,
    /// Follow every document with the tokenizer's end-of-document token (default true).
    pub append_eod: bool,
    /// Begin every document with the tokenizer's beginning-of-document token (default false).
    pub add_bos: bool,
    /// Start a new `<prefix>_NNNNN.bin/.idx` pair whenever a `.bin` reaches this many bytes;
    /// `None` writes one `<prefix>.bin/.idx`.
    pub shard_bytes: Option<u64>,
    /// Tokenization threads; `None` uses all cores.
    pub workers: Option<usize>,
    /// Show a progress bar (only ever drawn when stderr is a terminal).
    pub show_progress: bool,
    /// Polled between documents: a signal number it returns (SIGINT, SIGTERM) stops the run
    /// with [`DataError::Stopped`], its temporary files removed.
    pub stop: Option<fn() -> Option<i32>>,
}

impl Default for PreprocessOptions {
    fn default() -> Self {
        PreprocessOptions {
            inputs: Vec::new(),
            tokenizer: PathBuf::from("tokenizer.json"),
            output_prefix: PathBuf::from("dataset"),
            json_key: "text".into(),
            doc_separator: None,
            append_eod: true,
            add_bos: false,
            shard_bytes: None,
            workers: None,
            show_progress: true,
            stop: None,
        }
    }
}

/// One dataset [`preprocess`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct WrittenDataset {
    /// Its prefix: `<prefix>.bin` and `<prefix>.idx`.
    pub prefix: PathBuf,
    /// Documents (= sequences) in it.
    pub documents: u64,
    /// Tokens in it.
    pub tokens: u64,
}

/// What [`preprocess`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessSummary {
    /// Input files read.
    pub files: usize,
    /// Documents (= sequences) written.
    pub documents: u64,
    /// Tokens written, including the BOS and EOD ids added.
    pub tokens: u64,
    /// Bytes of the input files on disk.
    pub input_bytes: u64,
    /// Bytes of document text read (after decompression and JSON or Parquet decoding).
    pub text_bytes: u64,
    /// Bytes of the `.bin` files.
    pub output_bytes: u64,
    /// Token dtype of the `.bin` files.
    pub dtype: DType,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// Document text throughput in MB/s (10^6 bytes).
    pub mb_per_s: f64,
    /// The datasets written: one, or the shards in order.
    pub datasets: Vec<WrittenDataset>,
}

impl PreprocessSummary {
    /// The `.bin` of the first (or only) dataset.
    pub fn bin(&self) -> PathBuf {
        bin_path(&self.datasets[0].prefix)
    }

    /// The `.idx` of the first (or only) dataset.
    pub fn idx(&self) -> PathBuf {
        idx_path(&self.datasets[0].prefix)
    }
}

impl std::fmt::Display for PreprocessSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} input file{} ({:.2} MB), {} documents, {:.2} MB of text, {} tokens ({}), \
             {:.2} MB out, {:.1} s, {:.2} MB/s of text -> ",
            self.files,
            if self.files == 1 { "" } else { "s" },
            self.input_bytes as f64 / 1e6,
            self.documents,
            self.text_bytes as f64 / 1e6,
            self.tokens,
            self.dtype.name(),
            self.output_bytes as f64 / 1e6,
            self.seconds,
            self.mb_per_s,
        )?;
        match self.datasets.as_slice() {
            [one] => write!(
                f,
                "{} + {}",
                self.bin().display(),
                idx_path(&one.prefix).display()
            ),
            shards => {
                write!(
                    f,
                    "{} shards; as recipe datasets, weighted by tokens:",
                    shards.len()
                )?;
                for d in shards {
                    write!(
                        f,
                        "\n  - {{ prefix: {}, weight: {} }}",
                        d.prefix.display(),
                        d.tokens
                    )?;
                }
                Ok(())
            }
        }
    }
}

/// The prefix of shard `i` of `prefix`: `<prefix>_00000`, `<prefix>_00001`, …
pub fn shard_prefix(prefix: &Path, i: usize) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(format!("_{i:05}"));
    PathBuf::from(s)
}

/// The output being written: the current dataset and the ones sealed before it.
struct Output<'a> {
    opts: &'a PreprocessOptions,
    dtype: DType,
    writer: Option<IndexedDatasetWriter>,
    sealed: Vec<(SealedDataset, WrittenDataset)>,
    current: WrittenDataset,
}

impl Output<'_> {
    fn prefix(&self, i: usize) -> PathBuf {
        match self.opts.shard_bytes {
            Some(_) => shard_prefix(&self.opts.output_prefix, i),
            None => self.opts.output_prefix.clone(),
        }
    }

    fn add(&mut self, ids: &[u32]) -> Result<()> {
        let mut writer = match self.writer.take() {
            Some(w) => w,
            None => {
                let prefix = self.prefix(self.sealed.len());
                let w = IndexedDatasetWriter::create(&prefix, self.dtype)?;
                self.current = WrittenDataset {
                    prefix,
                    documents: 0,
                    tokens: 0,
                };
                w
            }
        };
        writer.add_document(ids)?;
        self.current.documents += 1;
        self.current.tokens += ids.len() as u64;
        if self
            .opts
            .shard_bytes
            .is_some_and(|max| writer.bytes() >= max)
        {
            self.sealed.push((writer.seal()?, self.current.clone()));
        } else {
            self.writer = Some(writer);
        }
        Ok(())
    }

    fn seal(&mut self) -> Result<()> {
        if let Some(writer) = self.writer.take() {
            self.sealed.push((writer.seal()?, self.current.clone()));
        }
        Ok(())
    }

    /// Seals the last dataset and renames them all into place; removes shards of the same
    /// prefix numbered past the new last one (left by an earlier, longer run).
    fn commit(mut self) -> Result<(u64, Vec<WrittenDataset>)> {
        self.seal()?;
        let (sealed, written): (Vec<_>, Vec<_>) = self.sealed.drain(..).unzip();
        let bytes = commit_all(sealed)?;
        if self.opts.shard_bytes.is_some() {
            for i in written.len().. {
                let stale = self.prefix(i);
                let (bin, idx) = (bin_path(&stale), idx_path(&stale));
                if !bin.exists() && !idx.exists() {
                    break;
                }
                tracing::info!(prefix = %stale.display(), "removing a shard of an earlier run");
                for p in [bin, idx] {
                    if p.exists() {
                        std::fs::remove_file(&p).map_err(|e| DataError::io(&p, e))?;
                    }
                }
            }
        }
        Ok((bytes, written))
    }
}

/// Tokenizes the inputs and writes a Megatron indexed dataset; see the module docs.
pub fn preprocess(opts: &PreprocessOptions) -> Result<PreprocessSummary> {
    let start = Instant::now();
    if opts.json_key.is_empty() {
        return Err(DataError::config("json_key", "must not be empty"));
    }
    if opts.shard_bytes == Some(0) {
        return Err(DataError::config("shard_size", "must be at least 1 byte"));
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
    check_output(opts)?;
    let files = expand_inputs(&opts.inputs)?;
    let tokenizer = load_tokenizer(&opts.tokenizer)?;
    let specials = Specials {
        bos: opts
            .add_bos
            .then(|| bos_id(&tokenizer, &opts.tokenizer))
            .transpose()?,
        eod: opts
            .append_eod
            .then(|| {
                eod_id(
                    &tokenizer,
                    &opts.tokenizer,
                    "--append-eod (or pass --append-eod false)",
                )
            })
            .transpose()?,
    };
    let dtype = DType::for_vocab_size(tokenizer.get_vocab_size(true));

    let mut input_bytes = 0u64;
    for f in &files {
        input_bytes += std::fs::metadata(f).map_err(|e| DataError::io(f, e))?.len();
    }
    let bar = progress_bar(opts.show_progress, input_bytes);
    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(n) = opts.workers {
        builder = builder.num_threads(n);
    }
    let pool = builder
        .build()
        .map_err(|e| DataError::config("workers", format!("cannot start thread pool: {e}")))?;

    let mut out = Output {
        opts,
        dtype,
        writer: None,
        sealed: Vec::new(),
        current: WrittenDataset {
            prefix: PathBuf::new(),
            documents: 0,
            tokens: 0,
        },
    };
    let (mut documents, mut tokens, mut text_bytes) = (0u64, 0u64, 0u64);
    let mut pending: Vec<(usize, String)> = Vec::new();
    let mut pending_bytes = 0usize;
    // A signal stops the run between documents, in a batch being tokenized too, and before the
    // output is renamed into place: dropping the output removes its temporary files.
    let stopped = || match opts.stop.and_then(|stop| stop()) {
        Some(signal) => Err(DataError::Stopped { signal }),
        None => Ok(()),
    };
    let mut flush = |pending: &mut Vec<(usize, String)>, out: &mut Output| -> Result<()> {
        let encoded = pool.install(|| {
            pending
                .par_iter()
                .map(|(f, doc)| {
                    stopped()?;
                    encode(&tokenizer, doc, specials, &files[*f], &opts.tokenizer)
                })
                .collect::<Result<Vec<Vec<u32>>>>()
        })?;
        for ids in &encoded {
            out.add(ids)?;
            tokens += ids.len() as u64;
        }
        documents += encoded.len() as u64;
        pending.clear();
        Ok(())
    };
    for (f, file) in files.iter().enumerate() {
        bar.set_message(format!("file {}/{}", f + 1, files.len()));
        for doc in read_documents(file, &opts.json_key, opts.doc_separator.as_deref())? {
            stopped()?;
            let doc = doc?;
            pending_bytes += doc.len();
            text_bytes += doc.len() as u64;
            pending.push((f, doc));
            if pending_bytes >= BATCH_BYTES {
                flush(&mut pending, &mut out)?;
                pending_bytes = 0;
            }
        }
        bar.inc(std::fs::metadata(file).map_or(0, |m| m.len()));
    }
    flush(&mut pending, &mut out)?;
    stopped()?;
    if documents == 0 {
        // Dropping the writer removes its temporary files; an existing dataset stays.
        return Err(DataError::EmptyDataset {
            path: opts.output_prefix.clone(),
            what: "the inputs contain no documents".into(),
        });
    }
    let (output_bytes, datasets) = out.commit()?;
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    Ok(PreprocessSummary {
        files: files.len(),
        documents,
        tokens,
        input_bytes,
        text_bytes,
        output_bytes,
        dtype,
        seconds,
        mb_per_s: text_bytes as f64 / 1e6 / seconds.max(1e-9),
        datasets,
    })
}

/// Checks, before any input is read, that the output can go where it is asked to: the prefix
/// names a file (not a directory, as `out/` would), its directory exists or can be made, and no
/// final `.bin`/`.idx` name (of the first shard, with shards) is taken by a directory.
fn check_output(opts: &PreprocessOptions) -> Result<()> {
    let prefix = &opts.output_prefix;
    let text = prefix.as_os_str().to_string_lossy();
    if prefix.file_name().is_none() || text.ends_with(std::path::MAIN_SEPARATOR) {
        return Err(DataError::config(
            "output_prefix",
            format!(
                "`{text}` names a directory, not a file prefix: write e.g. `{}`",
                prefix.join("dataset").display()
            ),
        ));
    }
    if let Some(parent) = prefix.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| {
            DataError::config(
                "output_prefix",
                format!(
                    "cannot create the output directory {}: {e}",
                    parent.display()
                ),
            )
        })?;
    }
    // An unwritable directory is found now, not after the first batch is tokenized.
    let dir = prefix.parent().filter(|p| !p.as_os_str().is_empty());
    let probe = crate::indexed::temporary(&dir.unwrap_or(Path::new(".")).join("write-check"));
    crate::indexed::create_fresh(&probe).map_err(|e| {
        DataError::config(
            "output_prefix",
            format!("cannot write in the output directory: {e}"),
        )
    })?;
    let _ = std::fs::remove_file(&probe);
    let first = match opts.shard_bytes {
        Some(_) => shard_prefix(prefix, 0),
        None => prefix.clone(),
    };
    for path in [bin_path(&first), idx_path(&first)] {
        if path.is_dir() {
            return Err(DataError::config(
                "output_prefix",
                format!("{} is a directory; choose another prefix", path.display()),
            ));
        }
    }
    Ok(())
}

fn progress_bar(show: bool, input_bytes: u64) -> ProgressBar {
    if !(show && std::io::stderr().is_terminal()) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(input_bytes);
    if let Ok(style) = ProgressStyle::with_template(
        "[{elapsed_precise}] tokenizing {msg} {wide_bar} {bytes}/{total_bytes}",
    ) {
        bar.set_style(style);
    }
    bar
}

/// The special ids around every document.
#[derive(Debug, Clone, Copy)]
struct Specials {
    bos: Option<u32>,
    eod: Option<u32>,
}

/// Token ids of one document between its special ids; errors name the input file.
fn encode(
    tokenizer: &tokenizers::Tokenizer,
    doc: &str,
    specials: Specials,
    file: &Path,
    tokenizer_path: &Path,
) -> Result<Vec<u32>> {
    let mut ids: Vec<u32> = specials.bos.into_iter().collect();
    ids.extend(crate::tokenizer::encode_long(tokenizer, doc).map_err(|e| {
        DataError::Tokenizer {
            path: tokenizer_path.to_path_buf(),
            message: format!("encoding a document of {} failed: {e}", file.display()),
        }
    })?);
    ids.extend(specials.eod);
    Ok(ids)
}
