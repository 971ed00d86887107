//! The architecture's pages stay true and the code keeps its shape. `docs/ARCHITECTURE.md`'s map
//! lists every module folder of the workspace, and the files each folder's row names are in that
//! folder; on it and on every design page (`docs/design/`) each file or folder path cited exists
//! and every type, variant, function, field or module named in code spans (`Llama::forward`,
//! `parallel::dp::ZeroStage`, ...) is defined in the sources. The file index is checked against
//! the files' headers (`architecture/index.rs`), the code's dependencies, struct sizes, fault
//! injection and file sizes against their rules (`architecture/code.rs`).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

#[path = "architecture/code.rs"]
mod code;
#[path = "architecture/index.rs"]
mod index;

const DOC: &str = "docs/ARCHITECTURE.md";

/// The design pages: every Markdown file of this folder.
const DESIGN: &str = "docs/design/";

/// Names from outside the workspace the page cites: candle's types and error variant, std's,
/// primitives, and crate names.
const EXTERNAL: [&str; 14] = [
    "candle_core",
    "Tensor",
    "Var",
    "CustomOp",
    "VarBuilder",
    "Error",
    "Io",
    "Display",
    "Option",
    "u32",
    "MAX",
    "model",
    "parallel",
    "pretrain",
];

/// Every file and folder under the repository root (build outputs and dot-folders aside), as
/// relative paths; folders end with `/`.
fn tree(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(root.join(&rel)) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name == "target" {
                continue;
            }
            let path = rel.join(&name);
            let s = path.to_string_lossy().into_owned();
            if e.path().is_dir() {
                out.push(format!("{s}/"));
                stack.push(path);
            } else {
                out.push(s);
            }
        }
    }
    out
}

/// `a{b,c}d` → `abd`, `acd` (every brace group, spaces after commas ignored).
fn expand(s: &str) -> Vec<String> {
    let Some(open) = s.find('{') else {
        return vec![s.to_string()];
    };
    let Some(close) = s[open..].find('}').map(|c| open + c) else {
        return vec![s.to_string()];
    };
    let (head, body, tail) = (&s[..open], &s[open + 1..close], &s[close + 1..]);
    body.split(',')
        .flat_map(|alt| expand(&format!("{head}{}{tail}", alt.trim())))
        .collect()
}

/// Whether `pattern` (with `*` matching within one path component) names `path`, or a suffix of
/// it starting at a component.
fn matches(pattern: &str, path: &str) -> bool {
    fn glob(p: &[u8], s: &[u8]) -> bool {
        match (p.first(), s.first()) {
            (None, None) => true,
            (Some(b'*'), _) => {
                glob(&p[1..], s) || (!s.is_empty() && s[0] != b'/' && glob(p, &s[1..]))
            }
            (Some(a), Some(b)) if a == b => glob(&p[1..], &s[1..]),
            _ => false,
        }
    }
    let (p, s) = (pattern.as_bytes(), path.as_bytes());
    glob(p, s) || (0..s.len()).any(|i| s[i] == b'/' && glob(p, &s[i + 1..]))
}

/// The backticked spans of `text`, a span broken over lines joined with one space.
fn spans(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect()
}

/// `rest` after a leading generic parameter list `<...>` (nested brackets counted).
fn skip_generics(rest: &str) -> &str {
    let mut depth = 0;
    for (i, c) in rest.char_indices() {
        match c {
            '<' => depth += 1,
            '>' => {
                depth -= 1;
                if depth == 0 {
                    return &rest[i + 1..];
                }
            }
            _ => {}
        }
    }
    rest
}

/// Whether span `s` is a file or folder path to check: components of word characters, dots,
/// dashes, globs and braces, and a folder (`/` at the end) or a file with a source or document
/// extension.
fn is_path(s: &str) -> bool {
    const EXT: [&str; 10] = [
        ".rs", ".md", ".yaml", ".cu", ".cuh", ".sh", ".py", ".toml", ".json", ".c",
    ];
    let chars = |c: char| c.is_alphanumeric() || "_./*{},-".contains(c);
    s.contains('/')
        && !s.starts_with('/')
        && s.chars().all(chars)
        && (s.ends_with('/') || EXT.iter().any(|e| s.ends_with(e)))
}

/// What the sources define: every name (types, traits, variants, constants, functions, fields
/// and modules), and per type the names defined in the files that define or implement it.
struct Defined {
    names: HashSet<String>,
    members: HashMap<String, HashSet<String>>,
}

impl Defined {
    /// Whether the path of names `cited` (`Type::member`, `module::Item`) is defined: a member
    /// after a type must be defined where that type is defined or implemented.
    fn has(&self, cited: &[String]) -> Result<(), String> {
        for (k, name) in cited.iter().enumerate() {
            if EXTERNAL.contains(&name.as_str()) {
                continue;
            }
            if !self.names.contains(name) {
                return Err(format!("`{name}` is defined nowhere"));
            }
            let owner = k.checked_sub(1).map(|j| &cited[j]);
            if let Some(members) = owner.and_then(|o| self.members.get(o)) {
                if !members.contains(name) {
                    return Err(format!("`{name}` is not a member of `{}`", cited[k - 1]));
                }
            }
        }
        Ok(())
    }
}

fn defined(root: &Path, files: &[String]) -> Defined {
    let mut names = HashSet::new();
    let mut per_file: Vec<(HashSet<String>, HashSet<String>)> = Vec::new();
    let word = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    for f in files.iter().filter(|f| f.ends_with(".rs")) {
        let Ok(text) = std::fs::read_to_string(root.join(f)) else {
            continue;
        };
        // A file or folder module is named after it.
        for part in f.trim_end_matches(".rs").split('/') {
            names.insert(part.to_string());
        }
        let (mut here, mut types) = (HashSet::new(), HashSet::new());
        for line in text.lines() {
            // `impl X`, `impl<T> X<T>`, `impl Trait for X`: X's members may be here.
            if let Some(rest) = line.trim_start().strip_prefix("impl") {
                let rest = skip_generics(rest.trim_start());
                let target = rest.rsplit(" for ").next().unwrap_or(rest);
                types.insert(word(target.trim_start()));
            }
            let t = line.trim_start();
            let t = t.strip_prefix("pub ").unwrap_or(t);
            let t = match t.strip_prefix("pub(") {
                Some(rest) => rest.split_once(") ").map_or(t, |(_, r)| r),
                None => t,
            };
            for kw in [
                "struct ", "enum ", "trait ", "type ", "fn ", "mod ", "const ", "static ",
            ] {
                if let Some(rest) = t.strip_prefix(kw) {
                    here.insert(word(rest));
                    if matches!(kw, "struct " | "enum " | "trait ") {
                        types.insert(word(rest));
                    }
                }
            }
            // Variants (`Name,` `Name {` `Name(`) and fields (`name: T,`).
            let w = word(t);
            if !w.is_empty() {
                let after = t[w.len()..].trim_start();
                let variant = w.starts_with(char::is_uppercase)
                    && (after.is_empty() || after.starts_with([',', '{', '(', '=']));
                let field = after.starts_with(':') && !after.starts_with("::");
                if variant || field {
                    here.insert(w);
                }
            }
        }
        names.extend(here.iter().cloned());
        per_file.push((here, types));
    }
    let mut members: HashMap<String, HashSet<String>> = HashMap::new();
    for (here, types) in &per_file {
        for t in types {
            members
                .entry(t.clone())
                .or_default()
                .extend(here.iter().cloned());
        }
    }
    Defined { names, members }
}

/// The names a code span cites: `Llama::forward(piece, x)` → `Llama`, `forward`;
/// `ExpertParallel::{dispatch, combine}` → `ExpertParallel`, `dispatch`, `combine`.
fn cited_names(span: &str) -> Vec<String> {
    let head = span.split(['(', ' ']).next().unwrap_or("");
    // A brace group may hold spaces: take it whole when the span is a path.
    let head = if span.contains("::{") {
        span.split('(').next().unwrap_or("")
    } else {
        head
    };
    expand(head)
        .into_iter()
        .flat_map(|p| {
            p.split("::")
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Whether a code span names Rust items: a path with `::`, or a type-like identifier
/// (`CamelCase`; not an environment variable or a formula).
fn is_code(s: &str) -> bool {
    let camel = |t: &str| {
        t.starts_with(|c: char| c.is_ascii_uppercase())
            && t.chars().any(|c| c.is_ascii_lowercase())
            && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    (s.contains("::") && !s.contains('/')) || camel(s)
}

/// The module folders among `files` (`src/` and the crates' `src/` trees) that no span cites.
fn unmapped<'a>(files: &'a [String], spans: &[String]) -> Vec<&'a str> {
    let cited: HashSet<&str> = spans.iter().map(String::as_str).collect();
    files
        .iter()
        .filter(|d| d.ends_with('/') && (d.starts_with("src/") || d.contains("/src/")))
        .filter(|d| {
            files
                .iter()
                .any(|f| f.ends_with(".rs") && f.starts_with(d.as_str()))
        })
        .filter(|d| !cited.contains(d.as_str()))
        .map(String::as_str)
        .collect()
}

/// The map's rows (`| `folder/` | ... |`): each folder with the file names (no `/`) its row
/// cites.
fn map_rows(doc: &str) -> Vec<(String, Vec<String>)> {
    doc.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("| `")?;
            let (folder, row) = rest.split_once("` |")?;
            folder.ends_with('/').then(|| {
                let named = spans(row)
                    .into_iter()
                    .filter(|s| !s.contains('/') && s.ends_with(".rs"))
                    .collect();
                (folder.to_string(), named)
            })
        })
        .collect()
}

/// What a page cites that does not exist: paths, and names the sources do not define.
fn unfounded(text: &str, files: &[String], defined: &Defined) -> Vec<String> {
    let mut problems = Vec::new();
    let all = spans(text);
    for span in all.iter().filter(|s| is_path(s)) {
        for p in expand(span) {
            if !files.iter().any(|f| matches(&p, f)) {
                problems.push(format!("`{span}`: no {p} in the repository"));
            }
        }
    }
    for span in all.iter().filter(|s| is_code(s)) {
        for path in expand(span.split('(').next().unwrap_or("")) {
            let names = cited_names(&path);
            if let Err(e) = defined.has(&names) {
                problems.push(format!("`{span}`: {e}"));
            }
        }
    }
    problems
}

#[test]
fn the_map_lists_every_module_folder_and_cites_only_what_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join(DOC)).unwrap();
    let files = tree(root);
    let mut problems = Vec::new();

    // Every folder of Rust modules is on the map.
    for dir in unmapped(&files, &spans(&doc)) {
        problems.push(format!("module folder `{dir}` is not on the map"));
    }
    // A row names files of its own folder.
    for (folder, named) in map_rows(&doc) {
        for f in named {
            if !files.contains(&format!("{folder}{f}")) {
                problems.push(format!(
                    "the row of `{folder}` names `{f}`, not in that folder"
                ));
            }
        }
    }
    let defined = defined(root, &files);
    problems.extend(unfounded(&doc, &files, &defined));
    assert!(problems.is_empty(), "{DOC}:\n{}", problems.join("\n"));
}

#[test]
fn the_design_pages_cite_only_what_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = tree(root);
    let defined = defined(root, &files);
    let mut problems = Vec::new();
    let pages = files
        .iter()
        .filter(|f| f.starts_with(DESIGN) && f.ends_with(".md"));
    for page in pages {
        let text = std::fs::read_to_string(root.join(page)).unwrap();
        for p in unfounded(&text, &files, &defined) {
            problems.push(format!("{page}: {p}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The checks fail where they should: a folder missing from a map, a path or a name that does
/// not exist.
#[test]
fn the_checks_catch_a_missing_folder_path_and_name() {
    let files: Vec<String> = ["src/", "src/train/", "src/train/mod.rs", "docs/perf.md"]
        .map(String::from)
        .to_vec();
    let map = spans("| `src/` | the crate |");
    assert_eq!(unmapped(&files, &map), ["src/train/"]);
    assert!(unmapped(&files, &spans("`src/` `src/train/`")).is_empty());
    assert!(files.iter().any(|f| matches("train/mod.rs", f)));
    assert!(files.iter().any(|f| matches("src/*/mod.rs", f)));
    assert!(!files.iter().any(|f| matches("train/zero.rs", f)));
    assert!(!files.iter().any(|f| matches("rain/mod.rs", f)));
    assert_eq!(
        expand("llama/{embedding,block}.rs"),
        ["llama/embedding.rs", "llama/block.rs"]
    );
    assert_eq!(
        cited_names("TensorParallel::{enter, exit}{,_grad}"),
        [
            "TensorParallel",
            "enter",
            "TensorParallel",
            "enter_grad",
            "TensorParallel",
            "exit",
            "TensorParallel",
            "exit_grad"
        ]
    );
    assert_eq!(
        cited_names("Llama::forward(piece, x)"),
        ["Llama", "forward"]
    );
    assert!(is_path("crates/model/src/llama/") && is_path("tests/moe.rs"));
    assert!(!is_path("max/mean") && !is_path("/proc/cpuinfo") && !is_path("runs x/"));
    assert!(is_code("Executor::step") && is_code("ZeroStage") && !is_code("dp"));
    let rows = map_rows("| `src/train/` | the loop (`mod.rs`), `zero.rs` and `tests/x.rs` |");
    assert_eq!(
        rows,
        [(
            "src/train/".to_string(),
            vec!["mod.rs".into(), "zero.rs".into()]
        )]
    );
}
