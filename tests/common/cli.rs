//! Running the `pretrain` binary from tests and reading what it said.

use std::path::Path;
use std::process::{Command, Output};

/// The binary under test.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pretrain"))
}

/// `pretrain preprocess` of `input` into `prefix` with the bundled tokenizer.
pub fn preprocess(input: &Path, prefix: &Path) -> Command {
    let mut cmd = bin();
    cmd.args(["preprocess", "--input"])
        .arg(input)
        .args(["--tokenizer", "data/shakespeare/tokenizer.json"])
        .arg("--output-prefix")
        .arg(prefix);
    cmd
}

/// The binary training the tiny recipe into `dir` with `--set {base},run.dir={dir},{set}`,
/// logging at `info`.
pub fn tiny(dir: &Path, base: &str, set: &str) -> Command {
    let mut cmd = bin();
    cmd.args(["--recipe", "recipes/tiny.yaml", "--set"])
        .arg(format!("{base},run.dir={},{set}", dir.display()))
        .env("RUST_LOG", "info");
    cmd
}

/// Everything a finished command printed, stdout then stderr.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Asserts that the command printed `needle`, showing everything it printed otherwise.
#[track_caller]
pub fn assert_says(o: &Output, needle: &str) {
    let t = text(o);
    assert!(t.contains(needle), "expected {needle:?} in:\n{t}");
}
