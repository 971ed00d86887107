//! Rules of the code's shape, checked on the sources: dependencies run one way (the planner uses
//! nothing of the trainer or the optimizer, the launcher nothing of the trainer), no struct of the
//! trainer gathers more than [`MAX_FIELDS`] fields, injected test faults are read in one place
//! (`src/faults.rs`), and no source file passes [`MAX_LINES`] lines.

use std::path::Path;

use super::tree;

/// The most fields a struct of `src/train/` may have before it wants grouping.
const MAX_FIELDS: usize = 12;

/// The most lines a source file may have.
const MAX_LINES: usize = 500;

/// The Rust files of `tree` under `prefix`.
fn rust_under<'a>(files: &'a [String], prefix: &'a str) -> impl Iterator<Item = &'a String> {
    files
        .iter()
        .filter(move |f| f.starts_with(prefix) && f.ends_with(".rs"))
}

/// The lines of `text` that are code (comments and doc comments left out).
fn code_lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines().filter(|l| !l.trim_start().starts_with("//"))
}

/// Whether a line of code reaches `module` of the crate (`crate::module`, or `module` inside a
/// `use crate::{...}` group on that line).
fn reaches(line: &str, module: &str) -> bool {
    let word = |s: &str| {
        s.split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .any(|w| w == module)
    };
    line.contains(&format!("crate::{module}::"))
        || line
            .split("crate::{")
            .skip(1)
            .any(|group| word(group.split('}').next().unwrap_or("")))
}

/// `(struct name, field count)` of every struct with named fields in `text`.
fn struct_fields(text: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = code_lines(text).collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let t = t.strip_prefix("pub ").unwrap_or(t);
        let t = match t.strip_prefix("pub(") {
            Some(rest) => rest.split_once(") ").map_or(t, |(_, r)| r),
            None => t,
        };
        let Some(rest) = t.strip_prefix("struct ") else {
            continue;
        };
        if !line.trim_end().ends_with('{') {
            continue; // a tuple or unit struct
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let (mut depth, mut fields) = (1i32, 0);
        for l in &lines[i + 1..] {
            if depth == 1 {
                let t = l.trim_start();
                let t = t.strip_prefix("pub ").unwrap_or(t);
                let t = match t.strip_prefix("pub(") {
                    Some(rest) => rest.split_once(") ").map_or(t, |(_, r)| r),
                    None => t,
                };
                let w: String = t
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let after = &t[w.len()..];
                if !w.is_empty() && after.starts_with(':') && !after.starts_with("::") {
                    fields += 1;
                }
            }
            depth += l.matches('{').count() as i32 - l.matches('}').count() as i32;
            if depth <= 0 {
                break;
            }
        }
        out.push((name, fields));
    }
    out
}

#[test]
fn dependencies_run_one_way_planner_and_launcher_use_nothing_of_the_trainer() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = tree(root);
    let mut problems = Vec::new();
    for (folder, banned) in [
        ("src/plan/", &["train", "optim"][..]),
        ("src/launch/", &["train"][..]),
        ("src/job/", &["train", "launch"][..]),
    ] {
        for f in rust_under(&files, folder) {
            let text = std::fs::read_to_string(root.join(f)).unwrap();
            for line in code_lines(&text) {
                for m in banned.iter().filter(|m| reaches(line, m)) {
                    problems.push(format!("{f}: uses `crate::{m}`: {}", line.trim()));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn no_struct_of_the_trainer_has_more_than_twelve_fields() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = tree(root);
    let mut problems = Vec::new();
    for f in rust_under(&files, "src/train/") {
        let text = std::fs::read_to_string(root.join(f)).unwrap();
        for (name, n) in struct_fields(&text) {
            if n > MAX_FIELDS {
                problems.push(format!(
                    "{f}: struct {name} has {n} fields (at most {MAX_FIELDS})"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn injected_faults_are_read_in_one_place() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = tree(root);
    let sources = files
        .iter()
        .filter(|f| f.ends_with(".rs") && (f.starts_with("src/") || f.contains("/src/")));
    let readers: Vec<&String> = sources
        .filter(|f| {
            std::fs::read_to_string(root.join(f)).is_ok_and(|t| t.contains("PRETRAIN_TEST_"))
        })
        .collect();
    assert_eq!(readers, ["src/faults.rs"]);
}

#[test]
fn no_source_file_passes_five_hundred_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = tree(root);
    let mut problems = Vec::new();
    for f in files.iter().filter(|f| f.ends_with(".rs")) {
        let lines = std::fs::read_to_string(root.join(f))
            .unwrap()
            .lines()
            .count();
        if lines > MAX_LINES {
            problems.push(format!("{f}: {lines} lines (at most {MAX_LINES})"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The rules' own parsing catches what it should: fields at the struct's depth only, tuple
/// structs left out, `crate::{...}` groups read.
#[test]
fn the_code_rules_count_fields_and_find_reaches() {
    let text = "/// doc { with a brace\npub struct A<'a> {\n    /// x: not a field\n    \
                pub x: usize,\n    pub(crate) y: Vec<u8>,\n    z: Option<&'a str>,\n}\n\
                struct T(usize);\nstruct B {\n    inner: Inner { },\n    w: HashMap<K, V>,\n}\n";
    assert_eq!(
        struct_fields(text),
        [("A".to_string(), 3), ("B".to_string(), 2)]
    );
    assert!(reaches("use crate::train::zero::state_layout;", "train"));
    assert!(reaches(
        "use crate::{recipe::Recipe, train::Trainer};",
        "train"
    ));
    assert!(!reaches(
        "use crate::{recipe::Recipe, trainer::X};",
        "train"
    ));
    assert!(!reaches("use model::placement::chunk_pieces;", "train"));
}
