//! Property-based tests of checkpoint reading against hostile manifests: values of a valid
//! manifest replaced by other JSON (numbers, huge numbers, strings, nulls, nested values),
//! entries removed, or the text mangled. Opening, finding the newest checkpoint and reading
//! blocks must return errors, never panic, and finish at once.

use std::path::Path;
use std::time::{Duration, Instant};

use ckpt::{finalize, find_latest, Checkpoint, Kind, Manifest, RankWriter, TensorBlock};
use proptest::prelude::*;
use serde_json::Value;

fn valid_checkpoint(root: &Path) -> std::path::PathBuf {
    let tok = root.join("tok.json");
    std::fs::write(&tok, "{}").unwrap();
    let mut w = RankWriter::new(root, 2, 0).unwrap();
    let b = TensorBlock {
        name: "w",
        global_shape: &[2, 3],
        offset: &[0, 0],
        shape: &[2, 3],
    };
    for kind in Kind::ADAMW {
        w.add(kind, b, 0..6, vec![0.25; 6]);
    }
    w.write().unwrap();
    let manifest = Manifest {
        format: String::new(),
        step: 2,
        consumed_samples: 16,
        seed: 1,
        model: serde_json::json!({}),
        recipe: String::new(),
        layout: serde_json::json!({}),
        trainer: Value::Null,
        files: vec![],
        pieces: vec![],
        tokenizer: None,
        datasets: vec![],
    };
    finalize(root, manifest, 1, &tok, 2).unwrap()
}

/// Every value of `v` (depth first), as JSON pointers.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    out.push(at.clone());
    match v {
        Value::Object(m) => m
            .iter()
            .for_each(|(k, c)| pointers(c, format!("{at}/{k}"), out)),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, c)| pointers(c, format!("{at}/{i}"), out)),
        _ => {}
    }
}

fn replacement() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        Just(Value::from(u64::MAX)),
        Just(Value::from(-1)),
        "[a-z/.]{0,12}".prop_map(Value::from),
        Just(serde_json::json!([[0, 18446744073709551615u64]])),
        Just(serde_json::json!({})),
        Just(serde_json::json!([])),
    ]
}

/// The cases random edits rarely reach: a whole shape or a piece's range claiming more elements
/// than the files hold.
#[test]
fn claimed_sizes_must_be_backed_by_data() {
    for (pointer, value) in [
        (
            "/pieces/0/global_shape",
            serde_json::json!([1u64 << 40, 1u64 << 40]),
        ),
        ("/pieces/0/global_shape", serde_json::json!([u64::MAX, 2])),
        ("/pieces/0/range", serde_json::json!([0, 1u64 << 40])),
        (
            "/pieces/0/block",
            serde_json::json!([[0, 1u64 << 40], [0, 3]]),
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = valid_checkpoint(tmp.path());
        let path = dir.join("manifest.json");
        let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        *v.pointer_mut(pointer).unwrap() = value;
        std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
        let e = Checkpoint::open(&dir).err().map(|e| e.to_string());
        assert!(e.is_some(), "{pointer} accepted");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn hostile_manifests_are_errors_not_panics(
        edits in prop::collection::vec((any::<prop::sample::Index>(), replacement()), 1..4),
        mangle in prop::option::of((any::<prop::sample::Index>(), any::<u8>())),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = valid_checkpoint(tmp.path());
        let path = dir.join("manifest.json");
        let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        for (at, new) in edits {
            let mut all = Vec::new();
            pointers(&v, String::new(), &mut all);
            let p = &all[at.index(all.len())];
            if p.is_empty() {
                v = new;
            } else if let Some(slot) = v.pointer_mut(p) {
                *slot = new;
            }
        }
        let mut text = serde_json::to_vec(&v).unwrap();
        if let Some((at, byte)) = mangle {
            let i = at.index(text.len());
            text[i] = byte;
        }
        std::fs::write(&path, &text).unwrap();
        let start = Instant::now();
        let _ = find_latest(tmp.path());
        if let Ok(ck) = Checkpoint::open(&dir) {
            for (name, shape) in ck.tensors() {
                for kind in Kind::ALL {
                    let _ = ck.read_tensor(&name, kind, &shape);
                }
            }
        }
        prop_assert!(start.elapsed() < Duration::from_secs(2));
    }
}
