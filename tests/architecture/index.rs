//! `docs/files.md`, the index of source files, is each file's first header sentence: every Rust
//! file of `src/` and of the crates' `src/` opens with a `//!` header, and the index row of each
//! is the header's first sentence. `PRETRAIN_WRITE_FILE_INDEX=1` rewrites the index from the
//! headers instead of failing.

use std::path::Path;

use super::tree;

const INDEX: &str = "docs/files.md";

/// The first sentence of a `//!` header (its first paragraph up to the first full stop followed
/// by a space), with rustdoc link brackets dropped; `None` when the file has no header.
fn header_sentence(text: &str) -> Option<String> {
    let mut para = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("//!") else {
            break;
        };
        let rest = rest.trim();
        if rest.is_empty() {
            break;
        }
        para.push(rest);
    }
    if para.is_empty() {
        return None;
    }
    let joined = para.join(" ");
    let mut end = joined.len();
    let bytes = joined.as_bytes();
    for (i, _) in joined.match_indices(". ") {
        let before = &joined[..i];
        let abbreviation = ["e.g", "i.e", "etc", "vs"]
            .iter()
            .any(|a| before.ends_with(a));
        // A full stop inside a code span is not one.
        let in_code = before.matches('`').count() % 2 == 1;
        if !abbreviation && !in_code && bytes.get(i + 2).is_some_and(|b| !b.is_ascii_lowercase()) {
            end = i + 1;
            break;
        }
    }
    Some(unlink(&joined[..end]))
}

/// `[`x`](path)` and `[`x`]` → `` `x` ``.
fn unlink(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(open) = rest.find("[`") {
        let Some(close) = rest[open..].find("`]").map(|c| open + c) else {
            break;
        };
        out.push_str(&rest[..open]);
        out.push_str(&rest[open + 1..close + 1]);
        rest = &rest[close + 2..];
        if rest.starts_with('(') {
            if let Some(p) = rest.find(')') {
                rest = &rest[p + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The index as it should read.
fn index(root: &Path, files: &[String]) -> Result<String, Vec<String>> {
    let mut sources: Vec<&String> = files
        .iter()
        .filter(|f| f.ends_with(".rs") && (f.starts_with("src/") || f.contains("/src/")))
        .collect();
    sources.sort();
    let mut out = String::from(
        "# Source files\n\nEvery Rust source file of the workspace and the first sentence of its \
         `//!` header.\nGenerated from the headers: `tests/architecture.rs` fails when they \
         differ, and\n`PRETRAIN_WRITE_FILE_INDEX=1 cargo test --release --test architecture` \
         rewrites this page.\nThe folders are described in [ARCHITECTURE.md](ARCHITECTURE.md).\n\n\
         | file | what it holds |\n|---|---|\n",
    );
    let mut missing = Vec::new();
    for f in sources {
        let text = std::fs::read_to_string(root.join(f)).unwrap();
        match header_sentence(&text) {
            Some(s) => out.push_str(&format!("| `{f}` | {} |\n", s.replace('|', "\\|"))),
            None => missing.push(format!("{f}: no `//!` header")),
        }
    }
    if missing.is_empty() {
        Ok(out)
    } else {
        Err(missing)
    }
}

#[test]
fn the_file_index_is_every_files_first_header_sentence() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = tree(root);
    let want = index(root, &files).unwrap_or_else(|m| panic!("{}", m.join("\n")));
    let path = root.join(INDEX);
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    if have != want && std::env::var_os("PRETRAIN_WRITE_FILE_INDEX").is_some() {
        std::fs::write(&path, &want).unwrap();
        return;
    }
    if have != want {
        let first = have
            .lines()
            .zip(want.lines())
            .find(|(h, w)| h != w)
            .map_or_else(
                || "(one is longer)".to_string(),
                |(h, w)| format!("has:  {h}\nwants: {w}"),
            );
        panic!(
            "{INDEX} differs from the files' headers; first difference:\n{first}\n\
             rewrite it with PRETRAIN_WRITE_FILE_INDEX=1 cargo test --release --test architecture"
        );
    }
}

#[test]
fn a_header_sentence_ends_at_its_first_full_stop_outside_code() {
    let text = "//! The planner: memory ([`memory`]), e.g. of `a.b`. More here.\n//! And more.\n";
    assert_eq!(
        header_sentence(text).unwrap(),
        "The planner: memory (`memory`), e.g. of `a.b`."
    );
    let text = "//! One line, then\n//! a second.\n//!\n//! Another paragraph.\nuse x;\n";
    assert_eq!(header_sentence(text).unwrap(), "One line, then a second.");
    assert_eq!(header_sentence("use x;\n"), None);
    assert_eq!(
        unlink("see [`Trainer`](crate::train::Trainer)."),
        "see `Trainer`."
    );
}
