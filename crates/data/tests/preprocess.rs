//! Preprocessing tests: text/JSONL → `.bin`/`.idx` → tokens round trip, separators, JSONL
//! errors, worker-count independence.

mod common;

use std::path::Path;

use data::indexed::{bin_path, idx_path};
use data::{load_tokenizer, preprocess, DataError, IndexedDataset, PreprocessOptions};

fn opts(inputs: Vec<String>, tokenizer: &Path, prefix: &Path) -> PreprocessOptions {
    PreprocessOptions {
        inputs,
        tokenizer: tokenizer.to_path_buf(),
        output_prefix: prefix.to_path_buf(),
        show_progress: false,
        ..Default::default()
    }
}

#[test]
fn text_and_jsonl_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let tok_path = common::small_tokenizer(dir.path());
    let input = dir.path().join("in");
    std::fs::create_dir_all(&input).unwrap();
    let texts = [
        "First document.\nWith two lines.",
        "Second: ÄÖÜ ✓ <tags>",
        "  third  ",
    ];
    std::fs::write(input.join("b.txt"), texts[0]).unwrap();
    std::fs::write(input.join("c.txt"), texts[1]).unwrap();
    std::fs::write(
        input.join("a.jsonl"),
        format!(
            "{}\n\n{}\n",
            serde_json::json!({"text": texts[2], "id": 1}),
            serde_json::json!({"text": "json two", "meta": {"x": [1]}})
        ),
    )
    .unwrap();
    let prefix = dir.path().join("out/ds");
    let summary = preprocess(&opts(
        vec![
            format!("{}/*.txt", input.display()),
            input.join("a.jsonl").display().to_string(),
        ],
        &tok_path,
        &prefix,
    ))
    .unwrap();
    // Files are sorted: a.jsonl (2 documents), b.txt, c.txt.
    let expected = [texts[2], "json two", texts[0], texts[1]];
    assert_eq!(summary.files, 3);
    assert_eq!(summary.documents, 4);
    assert!(summary.to_string().contains("4 documents"), "{summary}");

    let tok = load_tokenizer(&tok_path).unwrap();
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(ds.num_sequences(), 4);
    assert_eq!(ds.num_tokens(), summary.tokens);
    assert_eq!(
        std::fs::metadata(bin_path(&prefix)).unwrap().len(),
        summary.output_bytes
    );
    for (i, text) in expected.iter().enumerate() {
        let len = ds.sequence_lengths()[i] as usize;
        let ids = ds.get(i, 0, len).unwrap();
        assert_eq!(*ids.last().unwrap(), 0, "EOD closes document {i}");
        assert!(!ids[..len - 1].contains(&0));
        assert_eq!(ids[..len - 1], *tok.encode(*text, false).unwrap().get_ids());
        assert_eq!(tok.decode(&ids[..len - 1], false).unwrap(), *text);
    }
}

#[test]
fn separator_splits_text_files() {
    let dir = tempfile::tempdir().unwrap();
    let tok = common::small_tokenizer(dir.path());
    let f = dir.path().join("multi.txt");
    std::fs::write(&f, "one\n\n\ntwo\nlines\n\n\n\n\n\nthree").unwrap();
    let prefix = dir.path().join("sep");
    let mut o = opts(vec![f.display().to_string()], &tok, &prefix);
    o.doc_separator = Some("\n\n\n".into());
    assert_eq!(preprocess(&o).unwrap().documents, 3);
    o.doc_separator = None;
    assert_eq!(preprocess(&o).unwrap().documents, 1);
}

#[test]
fn jsonl_errors_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let tok = common::small_tokenizer(dir.path());
    let f = dir.path().join("corpus.jsonl");
    std::fs::write(
        &f,
        "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"content\": \"no text\"}\n",
    )
    .unwrap();
    let prefix = dir.path().join("j");
    let e = preprocess(&opts(vec![f.display().to_string()], &tok, &prefix)).unwrap_err();
    assert!(matches!(e, DataError::Jsonl { line: 3, .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("corpus.jsonl:3") && msg.contains("missing field `text`"),
        "{msg}"
    );

    // A custom key reads the same file further, then fails on line 1 which lacks it.
    let mut o = opts(vec![f.display().to_string()], &tok, &prefix);
    o.json_key = "content".into();
    let e = preprocess(&o).unwrap_err().to_string();
    assert!(
        e.contains("corpus.jsonl:1") && e.contains("`content`"),
        "{e}"
    );
}

#[test]
fn output_does_not_depend_on_worker_count() {
    let dir = tempfile::tempdir().unwrap();
    let tok = common::small_tokenizer(dir.path());
    let docs = common::write_docs(dir.path(), "w", 40);
    let mut outputs = Vec::new();
    for workers in [1usize, 2] {
        let prefix = dir.path().join(format!("w{workers}"));
        let mut o = opts(vec![format!("{}/*.txt", docs.display())], &tok, &prefix);
        o.workers = Some(workers);
        preprocess(&o).unwrap();
        outputs.push((
            std::fs::read(bin_path(&prefix)).unwrap(),
            std::fs::read(idx_path(&prefix)).unwrap(),
        ));
    }
    assert_eq!(outputs[0], outputs[1]);
}

#[test]
fn bad_inputs_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let tok = common::small_tokenizer(dir.path());
    let prefix = dir.path().join("x");
    let none = format!("{}/nothing/*.txt", dir.path().display());
    let e = preprocess(&opts(vec![none], &tok, &prefix)).unwrap_err();
    assert!(e.to_string().contains("matched no files"), "{e}");

    let csv = dir.path().join("table.csv");
    std::fs::write(&csv, "a,b").unwrap();
    let e = preprocess(&opts(vec![csv.display().to_string()], &tok, &prefix)).unwrap_err();
    assert!(e.to_string().contains("unsupported file name"), "{e}");

    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n").unwrap();
    let e = preprocess(&opts(vec![empty.display().to_string()], &tok, &prefix)).unwrap_err();
    assert!(matches!(e, DataError::EmptyDataset { .. }), "{e}");

    let text = dir.path().join("t.txt");
    std::fs::write(&text, "hello").unwrap();
    let e = preprocess(&opts(
        vec![text.display().to_string()],
        &dir.path().join("tok.json"),
        &prefix,
    ))
    .unwrap_err();
    assert!(e.to_string().contains("tok.json"), "{e}");
}

/// A failed run leaves an existing dataset of the same prefix intact and no partial files.
#[test]
fn a_failed_preprocess_keeps_the_existing_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let tok = common::small_tokenizer(dir.path());
    let good = dir.path().join("good.jsonl");
    std::fs::write(&good, "{\"text\": \"one\"}\n{\"text\": \"two\"}\n").unwrap();
    let prefix = dir.path().join("ds");
    preprocess(&opts(vec![good.display().to_string()], &tok, &prefix)).unwrap();
    let before = (
        std::fs::read(bin_path(&prefix)).unwrap(),
        std::fs::read(idx_path(&prefix)).unwrap(),
    );
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"fine\"}\nnot json\n").unwrap();
    preprocess(&opts(vec![bad.display().to_string()], &tok, &prefix)).unwrap_err();
    let after = (
        std::fs::read(bin_path(&prefix)).unwrap(),
        std::fs::read(idx_path(&prefix)).unwrap(),
    );
    assert!(before == after, "the earlier dataset was changed");
    let left = temporary_files(dir.path());
    assert!(left.is_empty(), "{left:?}");
    IndexedDataset::open(&prefix).unwrap();
}

/// The temporary files (`*.tmp`) left in `dir`.
fn temporary_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp") || n.ends_with(".old"))
        .collect()
}

/// A dataset `ds` of two documents preprocessed from `in.jsonl` in a new directory: the
/// directory, the input and the options that made it.
fn two_documents() -> (tempfile::TempDir, std::path::PathBuf, PreprocessOptions) {
    let dir = tempfile::tempdir().unwrap();
    let tok = common::small_tokenizer(dir.path());
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, "{\"text\": \"one\"}\n{\"text\": \"two\"}\n").unwrap();
    let o = opts(
        vec![input.display().to_string()],
        &tok,
        &dir.path().join("ds"),
    );
    preprocess(&o).unwrap();
    (dir, input, o)
}

fn sigterm() -> Option<i32> {
    Some(15)
}

#[test]
fn a_stopped_preprocess_writes_nothing_and_keeps_the_existing_dataset() {
    let (dir, _, o) = two_documents();
    let prefix = o.output_prefix.clone();
    let before = std::fs::read(bin_path(&prefix)).unwrap();
    let stopped = PreprocessOptions {
        stop: Some(sigterm),
        ..o
    };
    let e = preprocess(&stopped).unwrap_err();
    assert!(matches!(e, DataError::Stopped { signal: 15 }), "{e}");
    assert_eq!(std::fs::read(bin_path(&prefix)).unwrap(), before);
    let left = temporary_files(dir.path());
    assert!(left.is_empty(), "{left:?}");
}

/// Calls of [`late_sigint`] so far.
static POLLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// SIGINT from the fifth poll on: with two documents in one batch, after every document was
/// read and tokenized, just before the output would be renamed into place.
fn late_sigint() -> Option<i32> {
    let n = POLLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    (n >= 4).then_some(2)
}

/// A signal that comes while the last batch is tokenized stops the run before its output
/// replaces the existing dataset.
#[test]
fn a_signal_during_the_last_batch_still_stops_the_run() {
    let (dir, input, o) = two_documents();
    let prefix = o.output_prefix.clone();
    let before = std::fs::read(bin_path(&prefix)).unwrap();
    std::fs::write(&input, "{\"text\": \"three\"}\n{\"text\": \"four\"}\n").unwrap();
    let stopped = PreprocessOptions {
        stop: Some(late_sigint),
        ..o
    };
    let e = preprocess(&stopped).unwrap_err();
    assert!(matches!(e, DataError::Stopped { signal: 2 }), "{e}");
    assert!(POLLS.load(std::sync::atomic::Ordering::SeqCst) >= 5);
    assert_eq!(std::fs::read(bin_path(&prefix)).unwrap(), before);
    let left = temporary_files(dir.path());
    assert!(left.is_empty(), "{left:?}");
}

/// A sharded run whose renaming into place fails part way (a later shard's name is taken by a
/// directory) puts every shard of the earlier run back as it was.
#[test]
fn a_sharded_run_that_fails_to_commit_keeps_every_earlier_shard() {
    let dir = tempfile::tempdir().unwrap();
    let tok = common::small_tokenizer(dir.path());
    let input = dir.path().join("in.jsonl");
    let docs: String = (0..40)
        .map(|i| format!("{{\"text\": \"document {i} of the first run\"}}\n"))
        .collect();
    std::fs::write(&input, docs).unwrap();
    let prefix = dir.path().join("out/ds");
    let mut o = opts(vec![input.display().to_string()], &tok, &prefix);
    o.shard_bytes = Some(64);
    let first = preprocess(&o).unwrap();
    assert!(first.datasets.len() >= 4, "{}", first.datasets.len());
    let files = |n: usize| -> Vec<Vec<u8>> {
        (0..n)
            .flat_map(|i| {
                let p = data::preprocess::shard_prefix(&prefix, i);
                [bin_path(&p), idx_path(&p)]
            })
            .map(|p| std::fs::read(p).unwrap())
            .collect()
    };
    let before = files(first.datasets.len());
    // A second run of more shards, one of whose names past the first run's is a directory.
    let docs: String = (0..80)
        .map(|i| format!("{{\"text\": \"document {i} of the second run\"}}\n"))
        .collect();
    std::fs::write(&input, docs).unwrap();
    let taken = bin_path(&data::preprocess::shard_prefix(
        &prefix,
        first.datasets.len() + 1,
    ));
    std::fs::create_dir_all(&taken).unwrap();
    let e = preprocess(&o).unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");
    assert_eq!(files(first.datasets.len()), before);
    let later = data::preprocess::shard_prefix(&prefix, first.datasets.len());
    assert!(
        !bin_path(&later).exists(),
        "a shard of the failed run was left"
    );
    let left = temporary_files(&dir.path().join("out"));
    assert!(left.is_empty(), "{left:?}");
}

/// A prefix naming a directory, or a final name taken by a directory, is refused before any
/// input is read (the input here is not even valid).
#[test]
fn output_problems_are_found_before_the_inputs_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let tok = common::small_tokenizer(dir.path());
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "not json\n").unwrap();
    let refused = |prefix: &Path, shards: bool| {
        let mut o = opts(vec![bad.display().to_string()], &tok, prefix);
        o.shard_bytes = shards.then_some(1 << 20);
        preprocess(&o).unwrap_err().to_string()
    };
    let e = refused(&dir.path().join("out/"), false);
    assert!(e.contains("names a directory, not a file prefix"), "{e}");
    std::fs::create_dir_all(dir.path().join("d.bin")).unwrap();
    let e = refused(&dir.path().join("d"), false);
    assert!(e.contains("d.bin is a directory"), "{e}");
    std::fs::create_dir_all(dir.path().join("s_00000.idx")).unwrap();
    let e = refused(&dir.path().join("s"), true);
    assert!(e.contains("s_00000.idx is a directory"), "{e}");
    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    let e = refused(&file.join("x"), false);
    assert!(e.contains("cannot create the output directory"), "{e}");
}

/// A UTF-8 byte-order mark opening a file is not part of its first document.
#[test]
fn a_byte_order_mark_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let tok = common::small_tokenizer(dir.path());
    let tokens = |name: &str, bytes: &[u8]| {
        let input = dir.path().join(name);
        std::fs::write(&input, bytes).unwrap();
        let prefix = dir.path().join(format!("{name}.out"));
        preprocess(&opts(vec![input.display().to_string()], &tok, &prefix)).unwrap();
        std::fs::read(bin_path(&prefix)).unwrap()
    };
    let jsonl = "{\"text\": \"bom\"}\r\n{\"text\": \"crlf\"}\r\n";
    assert_eq!(
        tokens("bom.jsonl", &[b"\xEF\xBB\xBF", jsonl.as_bytes()].concat()),
        tokens("plain.jsonl", jsonl.as_bytes())
    );
    assert_eq!(
        tokens("bom.txt", b"\xEF\xBB\xBFSome text."),
        tokens("plain.txt", b"Some text.")
    );
}
