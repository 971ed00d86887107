//! Loader tests: determinism, data-parallel invariance, resume, blending, splits, masks and
//! errors, on synthetic datasets whose token values identify their dataset and document.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use data::{
    micro_batch_indices, DType, DataConfig, DataError, DatasetSpec, GptData, IndexedDatasetWriter,
    Split,
};

const SEQ: usize = 16;

/// `docs` documents; document `d` is `len(d)` copies of `base + d` followed by EOD (0).
fn synthetic(dir: &Path, name: &str, base: u32, docs: u32) -> PathBuf {
    let prefix = dir.join(name);
    let mut w = IndexedDatasetWriter::create(&prefix, DType::U16).unwrap();
    for d in 0..docs {
        let len = 5 + (d as usize * 7) % 40;
        let mut toks = vec![base + d; len];
        toks.push(0);
        w.add_document(&toks).unwrap();
    }
    w.finish().unwrap();
    prefix
}

struct Fixture {
    dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        common::small_tokenizer(dir.path());
        synthetic(dir.path(), "a", 1, 100);
        synthetic(dir.path(), "b", 201, 100);
        Fixture { dir }
    }

    fn cfg(&self, datasets: &[(&str, f64)], split: &str) -> DataConfig {
        DataConfig {
            datasets: datasets
                .iter()
                .map(|(p, w)| DatasetSpec {
                    prefix: PathBuf::from(p),
                    weight: *w,
                })
                .collect(),
            tokenizer: "tokenizer.json".into(),
            split: split.into(),
            eod_mask_loss: false,
            reset_attention_mask: false,
            reset_position_ids: false,
            attention_share: None,
        }
    }

    fn open(&self, cfg: &DataConfig, split: Split, seed: u64, n: u64) -> GptData {
        GptData::open(cfg, self.dir.path(), split, SEQ, seed, n).unwrap()
    }
}

fn global_batches(
    data: &GptData,
    start: u64,
    steps: usize,
    gb: usize,
    mb: usize,
    dp: usize,
) -> Vec<Vec<u32>> {
    (0..steps)
        .map(|s| {
            let consumed = start + (s * gb) as u64;
            let mut all = Vec::new();
            for r in 0..dp {
                for micro in micro_batch_indices(consumed, gb, mb, r, dp) {
                    assert_eq!(micro.len(), mb);
                    all.extend(data.batch(&micro).unwrap().tokens);
                }
            }
            all
        })
        .collect()
}

#[test]
fn batches_are_deterministic_per_seed() {
    let f = Fixture::new();
    let cfg = f.cfg(&[("a", 1.0)], "98,2");
    let a = f.open(&cfg, Split::Train, 1234, 256);
    let b = f.open(&cfg, Split::Train, 1234, 256);
    let c = f.open(&cfg, Split::Train, 1235, 256);
    let ga = global_batches(&a, 0, 8, 32, 4, 1);
    assert_eq!(ga, global_batches(&b, 0, 8, 32, 4, 1));
    assert_ne!(ga, global_batches(&c, 0, 8, 32, 4, 1));
    assert_eq!(a.eod_id(), Some(0));
    assert_eq!(a.vocab_size(), 400);
}

#[test]
fn batch_layout_and_labels() {
    let f = Fixture::new();
    let data = f.open(&f.cfg(&[("a", 1.0)], "98,2"), Split::Train, 7, 64);
    let b = data.batch(&[3, 9, 27]).unwrap();
    assert_eq!((b.micro_batch, b.seq_len), (3, SEQ));
    assert_eq!(b.tokens.len(), 3 * SEQ);
    for (r, &g) in [3u64, 9, 27].iter().enumerate() {
        let s = data.sample(g).unwrap();
        assert_eq!(s.len(), SEQ + 1);
        assert_eq!(b.tokens[r * SEQ..(r + 1) * SEQ], s[..SEQ]);
        assert_eq!(b.labels[r * SEQ..(r + 1) * SEQ], s[1..]);
    }
    assert!(b.loss_mask.iter().all(|&m| m == 1.0));
    let e = data.sample(64).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::OutOfRange {
                index: 64,
                len: 64,
                ..
            }
        ),
        "{e}"
    );
    let e = data.batch(&[0, 64]).unwrap_err().to_string();
    assert!(e.contains("sample 64 out of range (have 64)"), "{e}");
}

#[test]
fn eod_mask_loss_masks_eod_inputs() {
    let f = Fixture::new();
    let mut cfg = f.cfg(&[("a", 1.0)], "98,2");
    cfg.eod_mask_loss = true;
    let data = f.open(&cfg, Split::Train, 7, 64);
    let b = data.batch(&(0..64).collect::<Vec<_>>()).unwrap();
    let mut masked = 0;
    for (t, m) in b.tokens.iter().zip(&b.loss_mask) {
        assert_eq!(*m == 0.0, *t == 0);
        masked += (*m == 0.0) as usize;
    }
    assert!(masked > 0);
}

#[test]
fn data_parallel_size_does_not_change_the_global_order() {
    let f = Fixture::new();
    let data = f.open(
        &f.cfg(&[("a", 1.0), ("b", 1.0)], "98,2"),
        Split::Train,
        5,
        1024,
    );
    let dp1 = global_batches(&data, 0, 6, 32, 8, 1);
    let dp4 = global_batches(&data, 0, 6, 32, 2, 4);
    let dp2 = global_batches(&data, 0, 6, 32, 4, 2);
    assert_eq!(dp1, dp4);
    assert_eq!(dp1, dp2);
    // Rank slices are contiguous and cover the global batch exactly once.
    let mut all: Vec<u64> = (0..4)
        .flat_map(|r| micro_batch_indices(64, 32, 2, r, 4))
        .flatten()
        .collect();
    assert_eq!(all, (64..96).collect::<Vec<_>>());
    all.dedup();
    assert_eq!(all.len(), 32);
    assert!(micro_batch_indices(0, 32, 2, 4, 4).is_empty());
    assert!(micro_batch_indices(0, 32, 0, 0, 4).is_empty());
}

#[test]
fn resume_continues_exactly() {
    let f = Fixture::new();
    let cfg = f.cfg(&[("a", 2.0), ("b", 1.0)], "98,2");
    let full = global_batches(&f.open(&cfg, Split::Train, 11, 640), 0, 10, 64, 8, 2);
    // A restarted run (fresh open, possibly asking for more samples) resuming at consumed = 4 * 64.
    let resumed = global_batches(&f.open(&cfg, Split::Train, 11, 4000), 4 * 64, 6, 64, 16, 1);
    assert_eq!(full[4..], resumed[..]);
}

#[test]
fn blending_tracks_the_weights() {
    let f = Fixture::new();
    let data = f.open(
        &f.cfg(&[("a", 3.0), ("b", 1.0)], "100"),
        Split::Train,
        3,
        4000,
    );
    let mut from_a = 0usize;
    for i in 0..4000 {
        let s = data.sample(i).unwrap();
        let t = *s.iter().find(|&&t| t != 0).unwrap();
        assert!(
            s.iter().all(|&x| x == 0 || (t < 200) == (x < 200)),
            "sample mixes datasets"
        );
        from_a += (t < 200) as usize;
        if i >= 99 {
            let frac = from_a as f64 / (i + 1) as f64;
            assert!(
                (frac - 0.75).abs() < 0.01,
                "after {} samples: {frac}",
                i + 1
            );
        }
    }
}

fn docs_seen(data: &GptData, n: u64) -> BTreeSet<u32> {
    (0..n)
        .flat_map(|i| data.sample(i).unwrap())
        .filter(|&t| t != 0)
        .collect()
}

#[test]
fn splits_are_disjoint_document_ranges() {
    let f = Fixture::new();
    let cfg = f.cfg(&[("a", 1.0)], "90,10");
    let train = docs_seen(&f.open(&cfg, Split::Train, 1, 2000), 2000);
    let valid = docs_seen(&f.open(&cfg, Split::Valid, 1, 200), 200);
    // Documents 0..90 (tokens 1..=90) train, 90..100 (tokens 91..=100) valid.
    assert_eq!(train, (1..=90).collect());
    assert_eq!(valid, (91..=100).collect());
}

#[test]
fn open_errors_are_specific() {
    let f = Fixture::new();
    let tiny = synthetic(f.dir.path(), "tiny", 1, 8);
    let cfg = f.cfg(&[(tiny.to_str().unwrap(), 1.0)], "98,2");
    let e = GptData::open(&cfg, f.dir.path(), Split::Valid, SEQ, 0, 10)
        .err()
        .unwrap();
    assert!(
        e.to_string().starts_with("data.split:") && e.to_string().contains("valid"),
        "{e}"
    );
    // Nothing requested: an empty split is fine.
    assert!(GptData::open(&cfg, f.dir.path(), Split::Valid, SEQ, 0, 0).is_ok());

    let e = GptData::open(&cfg, f.dir.path(), Split::Train, 10_000, 0, 1)
        .err()
        .unwrap();
    assert!(e.to_string().contains("too few"), "{e}");

    let missing = f.cfg(&[("nope", 1.0)], "98,2");
    let e = GptData::open(&missing, f.dir.path(), Split::Train, SEQ, 0, 1)
        .err()
        .unwrap();
    assert!(e.to_string().contains("nope.idx"), "{e}");

    let mut bad = f.cfg(&[("a", 1.0)], "98,2");
    bad.tokenizer = "missing_tok.json".into();
    let e = GptData::open(&bad, f.dir.path(), Split::Train, SEQ, 0, 1)
        .err()
        .unwrap();
    assert!(e.to_string().contains("missing_tok.json"), "{e}");

    let bad = f.cfg(&[("a", 0.0)], "98,2");
    let e = GptData::open(&bad, f.dir.path(), Split::Train, SEQ, 0, 1)
        .err()
        .unwrap();
    assert!(e.to_string().starts_with("data.datasets[0].weight:"), "{e}");
}

#[test]
fn loader_types_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<GptData>();
    assert_send_sync::<data::IndexedDataset>();
}

/// Token ids outside the tokenizer's vocabulary are found when the dataset is opened, naming the
/// file and the document, not hours later when a sample happens to hold one.
#[test]
fn token_ids_outside_the_vocabulary_are_refused_at_open() {
    let f = Fixture::new();
    let prefix = f.dir.path().join("bad");
    let mut w = IndexedDatasetWriter::create(&prefix, DType::U16).unwrap();
    for d in 0..50u32 {
        let id = if d == 37 { 60_000 } else { 1 + d };
        w.add_document(&[id; 20]).unwrap();
    }
    w.finish().unwrap();
    let cfg = f.cfg(&[("bad", 1.0)], "100,0");
    let e = GptData::open(&cfg, f.dir.path(), Split::Train, SEQ, 0, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("bad") && e.contains("document 37") && e.contains("token id 60000"),
        "{e}"
    );
}
