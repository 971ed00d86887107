//! The checkpoint format on its own: pieces written by several "ranks" with different
//! tensor-parallel blocks and ZeRO-style element ranges are reassembled into any block; every
//! integrity failure is a specific error naming the file.

use std::path::{Path, PathBuf};

use ckpt::{
    finalize, find_latest, Checkpoint, CkptError, Kind, Manifest, PieceDtype, RankWriter,
    TensorBlock, Values,
};
use half::bf16;

/// The block at `offset` of extent `shape` of tensor `name` (whole shape `global_shape`).
fn block<'a>(
    name: &'a str,
    global_shape: &'a [usize],
    offset: &'a [usize],
    shape: &'a [usize],
) -> TensorBlock<'a> {
    TensorBlock {
        name,
        global_shape,
        offset,
        shape,
    }
}

/// Tensor "w" of shape [4, 6] with value 10·row + col; "n" of shape [6] with value col.
fn value(name: &str, r: usize, c: usize) -> f32 {
    if name == "w" {
        (10 * r + c) as f32
    } else {
        c as f32
    }
}

/// Writes step `step` as two ranks: rank r holds columns 3r..3r+3 of "w" (a tensor-parallel split
/// along dim 1), cut into two ZeRO-style element ranges; rank 0 alone holds "n".
fn write(root: &Path, step: u64) -> PathBuf {
    let (manifest, tok) = write_ranks(root, step);
    finalize(root, manifest, 2, &tok, 2).unwrap()
}

/// The ranks' part of [`write`]: the manifest to finalize and the tokenizer file.
fn write_ranks(root: &Path, step: u64) -> (Manifest, PathBuf) {
    let tok = root.join("tok.json");
    std::fs::write(&tok, "{}").unwrap();
    for rank in 0..2 {
        let mut w = RankWriter::new(root, step, rank).unwrap();
        let offset = [0, 3 * rank];
        let b = block("w", &[4, 6], &offset, &[4, 3]);
        let data: Vec<f32> = (0..12)
            .map(|e| value("w", e / 3, 3 * rank + e % 3))
            .collect();
        for kind in Kind::ADAMW {
            w.add(kind, b, 0..5, data[..5].to_vec());
            w.add(kind, b, 5..12, data[5..].to_vec());
            if rank == 0 {
                let n = block("n", &[6], &[0], &[6]);
                w.add(
                    kind,
                    n,
                    0..6,
                    (0..6).map(|c| value("n", 0, c)).collect::<Vec<f32>>(),
                );
            }
        }
        w.write().unwrap();
    }
    let manifest = Manifest {
        format: String::new(),
        step,
        consumed_samples: 32 * step,
        seed: 1,
        model: serde_json::json!({"hidden_size": 6}),
        recipe: "train: {}".into(),
        layout: serde_json::json!({"tp": 2}),
        trainer: serde_json::Value::Null,
        files: vec![],
        pieces: vec![],
        tokenizer: None,
        datasets: vec![],
    };
    (manifest, tok)
}

/// A failure writing the checkpoint's copy of the tokenizer (a full disk, here a directory in
/// its place) names the copy, not the tokenizer it was read from; nothing is published.
#[test]
fn a_failed_tokenizer_copy_names_the_copy() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let (manifest, tok) = write_ranks(root, 4);
    let copy = root.join("step-00000004.tmp").join("tokenizer.json");
    std::fs::create_dir(&copy).unwrap();
    let e = finalize(root, manifest, 2, &tok, 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&copy.display().to_string()), "{e}");
    assert!(!e.contains("tok.json"), "{e}");
    assert!(!root.join("step-00000004").exists() && !root.join("latest").exists());
}

#[test]
fn any_block_is_reassembled_from_the_pieces() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write(tmp.path(), 3);
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.manifest().consumed_samples, 96);
    assert_eq!(
        ck.tensors(),
        vec![("n".to_string(), vec![6]), ("w".to_string(), vec![4, 6])]
    );
    for ((r0, rn), (c0, cn)) in [
        ((0, 4), (0, 6)),
        ((1, 2), (2, 3)),
        ((0, 2), (0, 6)),
        ((3, 1), (5, 1)),
    ] {
        for kind in Kind::ADAMW {
            let (offset, shape) = ([r0, c0], [rn, cn]);
            let b = block("w", &[4, 6], &offset, &shape);
            let got = ck.read_block(kind, b).unwrap();
            let want: Vec<f32> = (0..rn)
                .flat_map(|r| (0..cn).map(move |c| value("w", r0 + r, c0 + c)))
                .collect();
            assert_eq!(got, want, "{b:?}");
        }
    }
    assert_eq!(
        ck.read_block(Kind::Master, block("n", &[6], &[2], &[3]))
            .unwrap(),
        vec![2.0, 3.0, 4.0]
    );
    assert_eq!(
        ck.read_tensor("n", Kind::Master, &[6]).unwrap(),
        (0..6).map(|c| c as f32).collect::<Vec<_>>()
    );
    assert!(ck.tokenizer_path().exists());
}

/// Moments stored as bf16 (`optimizer.state_dtype: bf16`) take two bytes a value, read back
/// widened exactly, and say so in the manifest; a manifest without piece types (written before
/// moments could be bf16) reads as f32.
#[test]
fn bf16_moments_are_stored_as_bf16_and_old_manifests_read_as_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let tok = root.join("tok.json");
    std::fs::write(&tok, "{}").unwrap();
    let b = block("w", &[4, 6], &[0, 0], &[4, 6]);
    let master: Vec<f32> = (0..24).map(|i| 0.1 * i as f32).collect();
    let rounded: Vec<bf16> = master.iter().map(|&x| bf16::from_f32(x)).collect();
    let mut w = RankWriter::new(root, 1, 0).unwrap();
    w.add(Kind::Master, b, 0..24, master.clone());
    w.add(Kind::ExpAvg, b, 0..24, Values::Bf16(rounded.clone()));
    w.add(Kind::ExpAvgSq, b, 0..10, rounded[..10].to_vec());
    w.add(Kind::ExpAvgSq, b, 10..24, rounded[10..].to_vec());
    w.write().unwrap();
    let manifest = Manifest {
        format: String::new(),
        step: 1,
        consumed_samples: 0,
        seed: 1,
        model: serde_json::json!({}),
        recipe: "train: {}".into(),
        layout: serde_json::json!({}),
        trainer: serde_json::Value::Null,
        files: vec![],
        pieces: vec![],
        tokenizer: None,
        datasets: vec![],
    };
    let dir = finalize(root, manifest, 1, &tok, 2).unwrap();
    let bytes = std::fs::metadata(dir.join("rank-00000.safetensors"))
        .unwrap()
        .len();
    assert!(bytes < 24 * (4 + 2 + 2) + 1024, "{bytes} bytes");
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.dtype(Kind::Master), PieceDtype::F32);
    assert_eq!(ck.dtype(Kind::ExpAvg), PieceDtype::Bf16);
    let widened: Vec<f32> = rounded.iter().map(|x| x.to_f32()).collect();
    assert_ne!(widened, master, "0.1 steps are not bf16 values");
    assert_eq!(ck.read_block(Kind::Master, b).unwrap(), master);
    for kind in [Kind::ExpAvg, Kind::ExpAvgSq] {
        assert_eq!(ck.read_block(kind, b).unwrap(), widened);
    }

    // The same pieces all f32, with a manifest that names no piece types.
    std::fs::create_dir(root.join("old")).unwrap();
    let dir = write(&root.join("old"), 3);
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    for p in m["pieces"].as_array_mut().unwrap() {
        assert_eq!(
            p.as_object_mut().unwrap().remove("dtype"),
            Some("f32".into())
        );
    }
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.dtype(Kind::ExpAvgSq), PieceDtype::F32);
    let want: Vec<f32> = (0..6).map(|c| c as f32).collect();
    assert_eq!(ck.read_tensor("n", Kind::ExpAvg, &[6]).unwrap(), want);
}

#[test]
fn shape_and_missing_tensors_are_mismatches() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = Checkpoint::open(&write(tmp.path(), 1)).unwrap();
    let e = ck.read_tensor("w", Kind::Master, &[4, 8]).unwrap_err();
    assert!(
        matches!(e, CkptError::Mismatch { .. }) && e.to_string().contains("[4, 6]"),
        "{e}"
    );
    let e = ck.read_tensor("lm_head", Kind::Master, &[4]).unwrap_err();
    assert!(e.to_string().contains("no master of tensor lm_head"), "{e}");
}

#[test]
fn truncated_corrupt_and_missing_files_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write(tmp.path(), 1);
    let shard = dir.join("rank-00001.safetensors");
    let bytes = std::fs::read(&shard).unwrap();

    std::fs::write(&shard, &bytes[..bytes.len() - 7]).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap();
    assert!(
        matches!(e, CkptError::Corrupt { what: "size", .. })
            && e.to_string().contains("rank-00001.safetensors"),
        "{e}"
    );

    let mut flipped = bytes.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x40;
    std::fs::write(&shard, &flipped).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap();
    assert!(
        matches!(e, CkptError::Corrupt { what: "sha256", .. })
            && e.to_string().contains("rank-00001"),
        "{e}"
    );

    std::fs::remove_file(&shard).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap();
    assert!(
        matches!(e, CkptError::MissingFile { .. })
            && e.to_string().contains("rank-00001.safetensors"),
        "{e}"
    );

    // The tokenizer copy is checked too: a changed byte changes the ids the model was trained on.
    let dir = write(tmp.path(), 2);
    let tok = dir.join("tokenizer.json");
    let mut text = std::fs::read(&tok).unwrap();
    text[0] ^= 0x01;
    std::fs::write(&tok, &text).unwrap();
    let e = Checkpoint::open(&dir).err().unwrap();
    assert!(
        matches!(e, CkptError::Corrupt { what: "sha256", .. })
            && e.to_string().contains("tokenizer.json"),
        "{e}"
    );
}

#[test]
fn incomplete_directories_are_never_chosen() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), 2);
    write(tmp.path(), 4);
    // A crash during a save leaves a temporary directory: never a candidate.
    std::fs::create_dir_all(tmp.path().join("step-00000006.tmp")).unwrap();
    assert_eq!(
        find_latest(tmp.path()).unwrap(),
        Some(tmp.path().join("step-00000004"))
    );
    // A newest step directory without a readable manifest is reported, not passed over.
    std::fs::create_dir_all(tmp.path().join("step-00000008")).unwrap();
    std::fs::write(tmp.path().join("latest"), "step-00000008").unwrap();
    let e = find_latest(tmp.path()).unwrap_err();
    assert!(
        matches!(e, CkptError::Mismatch { .. })
            && e.to_string().contains("step-00000008")
            && e.to_string().contains("incomplete checkpoint"),
        "{e}"
    );
    std::fs::remove_file(tmp.path().join("latest")).unwrap();
    assert!(find_latest(tmp.path())
        .unwrap_err()
        .to_string()
        .contains("step-00000008"));
    let e = Checkpoint::open(&tmp.path().join("step-00000008"))
        .err()
        .unwrap();
    assert!(
        matches!(e, CkptError::Incomplete { .. }) && e.to_string().contains("step-00000008"),
        "{e}"
    );
    // A manifest whose step differs from its directory's name.
    std::fs::remove_dir_all(tmp.path().join("step-00000008")).unwrap();
    std::fs::rename(
        tmp.path().join("step-00000004"),
        tmp.path().join("step-00000009"),
    )
    .unwrap();
    let e = find_latest(tmp.path()).unwrap_err().to_string();
    assert!(
        e.contains("manifest says step 4") && e.contains("step 9"),
        "{e}"
    );
    assert_eq!(find_latest(&tmp.path().join("nothing-here")).unwrap(), None);
}

/// A `latest` that is empty or names no directory is blamed as such (it used to be
/// reported as an incomplete checkpoint to move aside), and a checkpoint path that does not exist
/// says so.
#[test]
fn a_bad_latest_and_a_missing_checkpoint_are_named_as_such() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), 2);
    for (text, why) in [
        ("", "is empty"),
        (
            "step-00000099",
            "names step-00000099, which is not a checkpoint directory",
        ),
    ] {
        std::fs::write(tmp.path().join("latest"), text).unwrap();
        let e = find_latest(tmp.path()).unwrap_err().to_string();
        assert!(
            e.contains("latest") && e.contains(why) && e.contains("fix or remove it"),
            "{e}"
        );
    }
    let e = Checkpoint::open(&tmp.path().join("step-00000099"))
        .err()
        .unwrap();
    assert!(matches!(e, CkptError::NoCheckpoint { .. }), "{e}");
    assert!(
        e.to_string().contains("no such checkpoint directory"),
        "{e}"
    );
}

#[test]
fn only_the_newest_checkpoints_are_kept() {
    let tmp = tempfile::tempdir().unwrap();
    for s in 1..=4 {
        write(tmp.path(), s);
    }
    let mut names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec!["latest", "step-00000003", "step-00000004", "tok.json"]
    );
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("latest")).unwrap(),
        "step-00000004"
    );
}

#[test]
fn pruning_never_removes_the_new_checkpoint_or_later_steps() {
    let tmp = tempfile::tempdir().unwrap();
    for s in [5, 6, 7] {
        write(tmp.path(), s);
    }
    // A run restarted from an earlier checkpoint saves step 2 with keep = 2.
    write(tmp.path(), 2);
    for s in [2, 6, 7] {
        assert!(tmp.path().join(format!("step-{s:08}")).exists(), "step {s}");
    }
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("latest")).unwrap(),
        "step-00000002"
    );
    assert_eq!(
        find_latest(tmp.path()).unwrap(),
        Some(tmp.path().join("step-00000002"))
    );
}

/// A rank that leaves out a piece makes the save fail, naming the tensor and kind, and no
/// checkpoint appears.
#[test]
fn an_incomplete_checkpoint_is_refused_when_written() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let tok = root.join("tok.json");
    std::fs::write(&tok, "{}").unwrap();
    for rank in 0..2 {
        let mut w = RankWriter::new(root, 3, rank).unwrap();
        let offset = [0, 3 * rank];
        let b = block("w", &[4, 6], &offset, &[4, 3]);
        for kind in Kind::ADAMW {
            // Rank 1 skips the second moment of its block.
            if rank == 1 && kind == Kind::ExpAvgSq {
                continue;
            }
            w.add(kind, b, 0..12, vec![0.5; 12]);
        }
        w.write().unwrap();
    }
    let manifest = Manifest {
        format: String::new(),
        step: 3,
        consumed_samples: 0,
        seed: 1,
        model: serde_json::json!({}),
        recipe: String::new(),
        layout: serde_json::json!({}),
        trainer: serde_json::Value::Null,
        files: vec![],
        pieces: vec![],
        tokenizer: None,
        datasets: vec![],
    };
    let e = finalize(root, manifest, 2, &tok, 2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("exp_avg_sq of w has 12 of its 24 elements"),
        "{e}"
    );
    assert!(!root.join("step-00000003").exists());
}

/// A tensor carries the state of its optimizer: AdamW's two moments, or Muon's momentum. A
/// checkpoint with both kinds of tensors is complete; a tensor with neither is refused.
#[test]
fn tensors_carry_adamw_moments_or_muon_momentum() {
    let save = |kinds_of_b: &[Kind]| -> Result<(), String> {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let tok = root.join("tok.json");
        std::fs::write(&tok, "{}").unwrap();
        let mut w = RankWriter::new(root, 1, 0).unwrap();
        let a = block("a", &[2, 2], &[0, 0], &[2, 2]);
        for kind in Kind::ADAMW {
            w.add(kind, a, 0..4, vec![0.5; 4]);
        }
        let b = block("b", &[2, 3], &[0, 0], &[2, 3]);
        for &kind in kinds_of_b {
            w.add(kind, b, 0..6, vec![0.25; 6]);
        }
        w.write().unwrap();
        let manifest = Manifest {
            format: String::new(),
            step: 1,
            consumed_samples: 0,
            seed: 1,
            model: serde_json::json!({}),
            recipe: String::new(),
            layout: serde_json::json!({}),
            trainer: serde_json::Value::Null,
            files: vec![],
            pieces: vec![],
            tokenizer: None,
            datasets: vec![],
        };
        finalize(root, manifest, 1, &tok, 2)
            .map(|dir| {
                let ck = Checkpoint::open(&dir).unwrap();
                assert!(ck.has(Kind::Momentum, "b") && !ck.has(Kind::ExpAvg, "b"));
                let m = ck.read_tensor("b", Kind::Momentum, &[2, 3]).unwrap();
                assert_eq!(m, vec![0.25; 6]);
            })
            .map_err(|e| e.to_string())
    };
    save(&Kind::MUON).unwrap();
    let e = save(&[Kind::Master]).unwrap_err();
    assert!(e.contains("no exp_avg of b"), "{e}");
    let e = save(&[Kind::Master, Kind::ExpAvg]).unwrap_err();
    assert!(e.contains("no exp_avg_sq of b"), "{e}");
}

/// Shares streamed while they are written (their own file).
#[path = "format/streaming.rs"]
mod streaming;
