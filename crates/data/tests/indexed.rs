//! Indexed dataset format tests: the exact `.idx`/`.bin` bytes, dtype selection, and one
//! specific error per kind of corrupt file.

mod common;

use std::path::{Path, PathBuf};

use data::indexed::{bin_path, idx_path};
use data::{preprocess, DType, DataError, IndexedDataset, IndexedDatasetWriter, PreprocessOptions};

/// Hand-built expected `.idx` bytes for the given lengths, following the format field by field.
fn expected_idx(code: u8, lengths: &[i32], item: i64) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(b"MMIDIDX\x00\x00"); // magic, 9 bytes
    v.extend_from_slice(&1u64.to_le_bytes()); // version
    v.push(code); // dtype code
    v.extend_from_slice(&(lengths.len() as u64).to_le_bytes()); // sequence count
    v.extend_from_slice(&(lengths.len() as u64 + 1).to_le_bytes()); // document count
    for l in lengths {
        v.extend_from_slice(&l.to_le_bytes()); // i32 sequence lengths
    }
    let mut p = 0i64;
    for l in lengths {
        v.extend_from_slice(&p.to_le_bytes()); // i64 byte pointers
        p += *l as i64 * item;
    }
    for d in 0..=lengths.len() as i64 {
        v.extend_from_slice(&d.to_le_bytes()); // i64 document indices 0..=N
    }
    v
}

fn write(prefix: &Path, dtype: DType, docs: &[&[u32]]) {
    let mut w = IndexedDatasetWriter::create(prefix, dtype).unwrap();
    for d in docs {
        w.add_document(d).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn idx_and_bin_bytes_match_the_megatron_layout() {
    let dir = tempfile::tempdir().unwrap();
    let docs: [&[u32]; 3] = [&[1, 2, 3], &[65535, 0], &[7]];

    let p16 = dir.path().join("u16");
    write(&p16, DType::U16, &docs);
    let idx = std::fs::read(idx_path(&p16)).unwrap();
    assert_eq!(idx, expected_idx(8, &[3, 2, 1], 2));
    assert_eq!(idx.len(), 34 + 3 * 4 + 3 * 8 + 4 * 8);
    let bin = std::fs::read(bin_path(&p16)).unwrap();
    assert_eq!(bin, vec![1, 0, 2, 0, 3, 0, 0xff, 0xff, 0, 0, 7, 0]);

    let p32 = dir.path().join("i32");
    write(&p32, DType::I32, &docs);
    assert_eq!(
        std::fs::read(idx_path(&p32)).unwrap(),
        expected_idx(4, &[3, 2, 1], 4)
    );
    let bin = std::fs::read(bin_path(&p32)).unwrap();
    assert_eq!(&bin[12..16], &[0xff, 0xff, 0, 0]);
    assert_eq!(bin.len(), 6 * 4);

    for prefix in [&p16, &p32] {
        let ds = IndexedDataset::open(prefix).unwrap();
        assert_eq!(ds.num_sequences(), 3);
        assert_eq!(ds.num_documents(), 3);
        assert_eq!(ds.num_tokens(), 6);
        assert_eq!(ds.get(0, 0, 3).unwrap(), vec![1, 2, 3]);
        assert_eq!(ds.get(1, 0, 2).unwrap(), vec![65535, 0]);
        assert_eq!(ds.get(0, 1, 2).unwrap(), vec![2, 3]);
        assert!(matches!(ds.get(2, 0, 2), Err(DataError::OutOfRange { .. })));
        assert!(matches!(ds.get(3, 0, 1), Err(DataError::OutOfRange { .. })));
    }
    // uint16 cannot hold 65536.
    let mut w = IndexedDatasetWriter::create(&dir.path().join("x"), DType::U16).unwrap();
    assert!(matches!(
        w.add_document(&[65536]),
        Err(DataError::BadToken { .. })
    ));
}

/// Writes a tokenizer.json whose vocabulary has `size` entries (byte symbols, filler tokens,
/// then `<|endoftext|>` as an added special token).
fn big_vocab_tokenizer(path: &Path, size: usize) {
    let mut vocab = serde_json::Map::new();
    for c in tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet() {
        let id = vocab.len();
        vocab.insert(c.to_string(), id.into());
    }
    while vocab.len() < size - 1 {
        let id = vocab.len();
        vocab.insert(format!("<filler_{id}>"), id.into());
    }
    let eod = size - 1;
    vocab.insert("<|endoftext|>".into(), eod.into());
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": eod, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "post_processor": null, "decoder": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "vocab": vocab, "merges": []}
    });
    std::fs::write(path, json.to_string()).unwrap();
}

#[test]
fn token_dtype_follows_vocab_size() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("doc.txt");
    std::fs::write(&text, "abc def").unwrap();
    for (size, dtype, code) in [(65_499usize, DType::U16, 8u8), (65_500, DType::I32, 4)] {
        let tok = dir.path().join(format!("tok{size}.json"));
        big_vocab_tokenizer(&tok, size);
        let prefix = dir.path().join(format!("out{size}"));
        let s = preprocess(&PreprocessOptions {
            inputs: vec![text.display().to_string()],
            tokenizer: tok,
            output_prefix: prefix.clone(),
            show_progress: false,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.dtype, dtype);
        assert_eq!(std::fs::read(idx_path(&prefix)).unwrap()[17], code);
        // 7 bytes, no merges: 7 tokens + EOD.
        assert_eq!(s.tokens, 8);
        assert_eq!(s.output_bytes, 8 * dtype.size() as u64);
        let ds = IndexedDataset::open(&prefix).unwrap();
        assert_eq!(ds.get(0, 7, 1).unwrap(), vec![size as u32 - 1]);
    }
}

/// A valid 3-sequence uint16 dataset to corrupt.
fn valid(dir: &Path) -> PathBuf {
    let p = dir.join("ok");
    write(&p, DType::U16, &[&[1, 2, 3], &[4, 5], &[6]]);
    p
}

fn corrupt_idx(prefix: &Path, f: impl FnOnce(&mut Vec<u8>)) -> DataError {
    let mut bytes = std::fs::read(idx_path(prefix)).unwrap();
    f(&mut bytes);
    std::fs::write(idx_path(prefix), bytes).unwrap();
    IndexedDataset::open(prefix).unwrap_err()
}

#[test]
fn every_corruption_has_its_own_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = valid(dir.path());
    let ok_idx = std::fs::read(idx_path(&p)).unwrap();
    let reset = || std::fs::write(idx_path(&p), &ok_idx).unwrap();

    let e = corrupt_idx(&p, |b| b[0] = b'X');
    assert!(matches!(e, DataError::BadMagic { .. }), "{e}");
    assert!(e.to_string().contains("ok.idx") && e.to_string().contains("magic"));
    reset();

    let e = corrupt_idx(&p, |b| b[9] = 2);
    assert!(matches!(e, DataError::BadVersion { found: 2, .. }), "{e}");
    assert!(
        e.to_string().contains("`version`: expected 1, found 2"),
        "{e}"
    );
    reset();

    let e = corrupt_idx(&p, |b| b[17] = 9);
    assert!(matches!(e, DataError::UnknownDtype { code: 9, .. }), "{e}");
    reset();
    let e = corrupt_idx(&p, |b| b[17] = 7);
    assert!(
        matches!(
            e,
            DataError::UnsupportedDtype {
                dtype: "float32",
                ..
            }
        ),
        "{e}"
    );
    reset();

    let e = corrupt_idx(&p, |b| b.truncate(30));
    assert!(
        matches!(
            e,
            DataError::Truncated {
                field: "document_count",
                expected: 34,
                found: 30,
                ..
            }
        ),
        "{e}"
    );
    reset();
    let e = corrupt_idx(&p, |b| b.truncate(34 + 12 + 10));
    assert!(
        matches!(
            e,
            DataError::Truncated {
                field: "sequence_pointers",
                ..
            }
        ),
        "{e}"
    );
    reset();
    let e = corrupt_idx(&p, |b| b.truncate(b.len() - 1));
    assert!(
        matches!(
            e,
            DataError::Truncated {
                field: "document_indices",
                ..
            }
        ),
        "{e}"
    );
    reset();
    let e = corrupt_idx(&p, |b| b.extend_from_slice(&[0; 5]));
    assert!(
        matches!(
            e,
            DataError::Inconsistent {
                field: "file length",
                ..
            }
        ),
        "{e}"
    );
    reset();

    // Sizes and pointers disagree: pointer[1] should be 3 tokens * 2 bytes = 6.
    let e = corrupt_idx(&p, |b| b[34 + 12 + 8] = 8);
    match &e {
        DataError::Inconsistent {
            field,
            index,
            expected,
            found,
            ..
        } => {
            assert_eq!(
                (*field, *index, expected.as_str(), found.as_str()),
                ("sequence_pointers", 1, "6", "8")
            );
        }
        other => panic!("wrong error {other}"),
    }
    reset();
    // Negative sequence length.
    let e = corrupt_idx(&p, |b| b[34 + 3] = 0x80);
    assert!(
        matches!(
            e,
            DataError::Inconsistent {
                field: "sequence_lengths",
                ..
            }
        ),
        "{e}"
    );
    reset();
    // Document indices not monotone (0, 2, 1, 3).
    let e = corrupt_idx(&p, |b| {
        let at = 34 + 12 + 24;
        b[at + 8] = 2;
        b[at + 16] = 1;
    });
    assert!(
        matches!(
            e,
            DataError::Inconsistent {
                field: "document_indices",
                index: 2,
                ..
            }
        ),
        "{e}"
    );
    reset();
    // Document indices not ending at the sequence count.
    let e = corrupt_idx(&p, |b| {
        let last = b.len() - 8;
        b[last] = 2;
    });
    assert!(
        matches!(
            e,
            DataError::Inconsistent {
                field: "document_indices",
                ..
            }
        ),
        "{e}"
    );
    reset();

    // .bin shorter than the pointers say.
    let bin = std::fs::read(bin_path(&p)).unwrap();
    std::fs::write(bin_path(&p), &bin[..bin.len() - 2]).unwrap();
    let e = IndexedDataset::open(&p).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::BinTruncated {
                expected: 12,
                found: 10,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("ok.bin"), "{e}");
    std::fs::write(bin_path(&p), &bin).unwrap();

    // Missing .bin.
    std::fs::remove_file(bin_path(&p)).unwrap();
    let e = IndexedDataset::open(&p).unwrap_err();
    assert!(
        matches!(e, DataError::Io { .. }) && e.to_string().contains("ok.bin"),
        "{e}"
    );
    std::fs::write(bin_path(&p), &bin).unwrap();
    assert!(IndexedDataset::open(&p).is_ok());
}

#[test]
fn empty_datasets_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let none = dir.path().join("none");
    write(&none, DType::U16, &[]);
    let e = IndexedDataset::open(&none).unwrap_err();
    assert!(matches!(e, DataError::EmptyDataset { .. }), "{e}");
    let zeros = dir.path().join("zeros");
    write(&zeros, DType::U16, &[&[], &[]]);
    let e = IndexedDataset::open(&zeros).unwrap_err();
    assert!(matches!(e, DataError::EmptyDataset { .. }), "{e}");
}
