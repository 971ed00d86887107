//! End-to-end test on the bundled Shakespeare corpus with the committed tokenizer, and a check
//! that the committed dataset `data/shakespeare/shakespeare.{bin,idx}` is reproducible.

mod common;

use std::path::Path;

use data::{
    preprocess, DataConfig, DatasetSpec, GptData, PreprocessOptions, PreprocessSummary, Split,
};

fn preprocess_corpus(prefix: &Path) -> PreprocessSummary {
    let dir = common::shakespeare_dir();
    preprocess(&PreprocessOptions {
        inputs: vec![format!("{}/*.txt", dir.display())],
        tokenizer: dir.join("tokenizer.json"),
        output_prefix: prefix.to_path_buf(),
        show_progress: false,
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn bundled_corpus_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("shakespeare");
    let s = preprocess_corpus(&prefix);
    eprintln!("{s}");
    assert_eq!(s.files, 8);
    assert_eq!(s.documents, 8);
    assert_eq!(s.input_bytes, 1_036_467);
    assert_eq!(s.dtype, data::DType::U16);
    // Byte-level BPE with 4096 entries compresses English prose roughly 3-4x.
    assert!(s.tokens > 200_000 && s.tokens < 400_000, "{}", s.tokens);

    // Every play decodes back to its exact text, followed by the EOD id.
    let tok = data::load_tokenizer(common::shakespeare_dir().join("tokenizer.json")).unwrap();
    let ds = data::IndexedDataset::open(&prefix).unwrap();
    let mut plays: Vec<_> = std::fs::read_dir(common::shakespeare_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    plays.sort();
    for (i, play) in plays.iter().enumerate() {
        let len = ds.sequence_lengths()[i] as usize;
        let ids = ds.get(i, 0, len).unwrap();
        assert_eq!(ids[len - 1], 0);
        let text = tok.decode(&ids[..len - 1], false).unwrap();
        assert!(
            text == std::fs::read_to_string(play).unwrap(),
            "{}",
            play.display()
        );
    }

    let cfg = DataConfig {
        datasets: vec![DatasetSpec {
            prefix: prefix.clone(),
            weight: 1.0,
        }],
        tokenizer: common::shakespeare_dir().join("tokenizer.json"),
        split: "90,10".into(),
        eod_mask_loss: false,
        reset_attention_mask: false,
        reset_position_ids: false,
        attention_share: None,
    };
    let train = GptData::open(&cfg, tmp.path(), Split::Train, 256, 1234, 10_000).unwrap();
    let valid = GptData::open(&cfg, tmp.path(), Split::Valid, 256, 1234, 100).unwrap();
    assert_eq!(train.vocab_size(), 4096);
    assert_eq!(train.eod_id(), Some(0));
    eprintln!(
        "samples per epoch at seq_len 256: train {:?}, valid {:?}",
        train.samples_per_epoch(),
        valid.samples_per_epoch()
    );
    let b = train.batch(&[0, 1, 2, 3]).unwrap();
    assert!(b.tokens.iter().all(|&t| (t as usize) < 4096));
    let text = tok.decode(&b.tokens[..256], false).unwrap();
    assert!(text.chars().any(|c| c.is_alphabetic()), "{text}");

    // The default 98,2 split leaves 8 documents without a valid document: a clear error.
    let mut default_split = cfg.clone();
    default_split.split = "98,2".into();
    let e = GptData::open(&default_split, tmp.path(), Split::Valid, 256, 1, 10)
        .err()
        .unwrap();
    assert!(e.to_string().contains("data.split"), "{e}");
}

/// The committed dataset `data/shakespeare/shakespeare.{bin,idx}` (scenes as documents, split at
/// three consecutive newlines) is exactly what `pretrain preprocess` makes from the bundled texts.
#[test]
fn committed_dataset_is_reproducible() {
    let dir = common::shakespeare_dir();
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("shakespeare");
    let s = preprocess(&PreprocessOptions {
        inputs: vec![format!("{}/*_gut.txt", dir.display())],
        tokenizer: dir.join("tokenizer.json"),
        output_prefix: prefix.clone(),
        doc_separator: Some("\n\n\n".into()),
        show_progress: false,
        ..Default::default()
    })
    .unwrap();
    assert!(s.documents > 150, "{s}");
    for ext in ["bin", "idx"] {
        let fresh = std::fs::read(prefix.with_extension(ext)).unwrap();
        let committed = std::fs::read(dir.join("shakespeare").with_extension(ext)).unwrap();
        assert!(
            fresh == committed,
            "data/shakespeare/shakespeare.{ext} differs from a fresh preprocess"
        );
    }
}
