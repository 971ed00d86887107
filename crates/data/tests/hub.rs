//! Hub-format tests against fixtures written by the reference implementations
//! (`scripts/make_hub_fixtures.py`): Parquet files written by pyarrow (zstd with data page v2,
//! page checksums and dictionaries; snappy with v1 pages and large strings) give the dataset of
//! the same documents as JSONL, and a tokenizer laid out like Llama 3's, with `add_bos` and
//! `append_eod`, gives exactly the ids the Hugging Face `tokenizers` library gives.

use std::path::{Path, PathBuf};

use data::indexed::{bin_path, idx_path};
use data::{preprocess, IndexedDataset, PreprocessOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hub")
        .join(name)
}

fn run(input: &str, prefix: &Path, tokenizer: &str, bos: bool) -> data::PreprocessSummary {
    preprocess(&PreprocessOptions {
        inputs: vec![fixture(input).display().to_string()],
        tokenizer: fixture(tokenizer),
        output_prefix: prefix.to_path_buf(),
        add_bos: bos,
        show_progress: false,
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn pyarrow_parquet_gives_the_jsonl_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let tok = "llama3_like_tokenizer.json";
    let reference = dir.path().join("jsonl");
    run("docs.jsonl", &reference, tok, false);
    let want = (
        std::fs::read(bin_path(&reference)).unwrap(),
        std::fs::read(idx_path(&reference)).unwrap(),
    );
    for input in ["fineweb_like.parquet", "snappy_v1.parquet"] {
        let prefix = dir.path().join(input);
        let s = run(input, &prefix, tok, false);
        assert_eq!(s.documents, 120);
        let got = (
            std::fs::read(bin_path(&prefix)).unwrap(),
            std::fs::read(idx_path(&prefix)).unwrap(),
        );
        assert!(got == want, "{input} differs from docs.jsonl");
    }
}

#[test]
fn a_llama3_style_tokenizer_gives_the_reference_ids() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("llama3");
    run(
        "fineweb_like.parquet",
        &prefix,
        "llama3_like_tokenizer.json",
        true,
    );
    let expected: Vec<Vec<u32>> =
        serde_json::from_slice(&std::fs::read(fixture("expected_ids.json")).unwrap()).unwrap();
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(ds.num_sequences(), expected.len());
    for (i, want) in expected.iter().enumerate() {
        let got = ds.get(i, 0, ds.sequence_lengths()[i] as usize).unwrap();
        assert_eq!(&got, want, "document {i}");
        assert_eq!((got[0], *got.last().unwrap()), (600, 601));
    }

    // Training reads the same end-of-text id from the tokenizer.
    let cfg: data::DataConfig = serde_json::from_value(serde_json::json!({
        "datasets": [{ "prefix": prefix }],
        "tokenizer": fixture("llama3_like_tokenizer.json"),
        "split": "90,10",
    }))
    .unwrap();
    let gpt = data::GptData::open(&cfg, dir.path(), data::Split::Train, 64, 1, 8).unwrap();
    assert_eq!(gpt.eod_id(), Some(601));
}
