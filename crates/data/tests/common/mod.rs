//! Shared helpers for the integration tests: a small trained tokenizer, text corpora and
//! preprocessed datasets in temporary directories.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use data::{preprocess, train_tokenizer, PreprocessOptions, TokenizerTrainOptions};

/// Path of the repository's `data/shakespeare` directory.
pub fn shakespeare_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/shakespeare")
}

/// A ~40 kB slice of Hamlet: enough text for quick tokenizer training.
pub fn small_text() -> String {
    let full = std::fs::read_to_string(shakespeare_dir().join("hamlet_gut.txt")).unwrap();
    let mut end = 40_000.min(full.len());
    while !full.is_char_boundary(end) {
        end -= 1;
    }
    full[..end].to_string()
}

/// Trains a small (vocab 400) tokenizer on [`small_text`] into `dir/tokenizer.json`.
pub fn small_tokenizer(dir: &Path) -> PathBuf {
    let corpus = dir.join("train_corpus.txt");
    std::fs::write(&corpus, small_text()).unwrap();
    let output = dir.join("tokenizer.json");
    train_tokenizer(&TokenizerTrainOptions {
        inputs: vec![corpus],
        vocab_size: 400,
        min_frequency: 2,
        output: output.clone(),
        show_progress: false,
    })
    .unwrap();
    output
}

/// Writes `n` synthetic documents of varied length into `dir/docs_{tag}/doc_XXX.txt`.
pub fn write_docs(dir: &Path, tag: &str, n: usize) -> PathBuf {
    let text = small_text();
    let words: Vec<&str> = text.split_whitespace().collect();
    let d = dir.join(format!("docs_{tag}"));
    std::fs::create_dir_all(&d).unwrap();
    for i in 0..n {
        let len = 20 + (i * 37) % 150;
        let start = (i * 131) % (words.len() - len);
        let body = format!("[{tag} {i}] {}", words[start..start + len].join(" "));
        std::fs::write(d.join(format!("doc_{i:03}.txt")), body).unwrap();
    }
    d
}

/// Preprocesses `dir/docs_{tag}/*.txt` into `dir/{tag}` with `tokenizer`; returns the prefix.
pub fn make_dataset(dir: &Path, tokenizer: &Path, tag: &str, n: usize) -> PathBuf {
    let docs = write_docs(dir, tag, n);
    let prefix = dir.join(tag);
    preprocess(&PreprocessOptions {
        inputs: vec![format!("{}/*.txt", docs.display())],
        tokenizer: tokenizer.to_path_buf(),
        output_prefix: prefix.clone(),
        show_progress: false,
        ..Default::default()
    })
    .unwrap();
    prefix
}
