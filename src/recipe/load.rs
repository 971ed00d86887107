//! Reading a recipe: YAML parsing, `inherit:` chains, `--set` overrides, typed deserialisation.

use std::path::{Path, PathBuf};

use serde_yaml::{Mapping, Value};

use super::Recipe;

/// Why a recipe could not be used.
#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    /// The file could not be read.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        /// The operating system's error (in the message, not repeated as a cause).
        error: std::io::Error,
    },
    /// The YAML is malformed (with line and column) or a key has the wrong type.
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// An `inherit:` chain returns to a file already in it.
    #[error("{path}: inherit cycle through {path}")]
    InheritCycle { path: PathBuf },
    /// A `--set` argument is malformed.
    #[error("--set {arg}: {message}")]
    Override { arg: String, message: String },
    /// The recipe parsed but is inconsistent; one line per problem.
    #[error("invalid recipe {path}:\n  {}", problems.join("\n  "))]
    Invalid {
        path: PathBuf,
        problems: Vec<String>,
    },
}

/// Largest recipe file read (recipes are a few kilobytes).
pub const MAX_RECIPE_BYTES: u64 = 1 << 20;
/// Deepest nesting of YAML flow collections (`[`, `{`) accepted.
pub const MAX_NESTING: usize = 64;

/// Parses YAML text, refusing nesting deeper than [`MAX_NESTING`] before the parser sees it
/// (its time grows with the square of the depth).
fn parse(text: &str, path: &Path) -> Result<Value, RecipeError> {
    check_depth(text).map_err(|message| RecipeError::Parse {
        path: path.into(),
        message,
    })?;
    serde_yaml::from_str(text).map_err(|e| RecipeError::Parse {
        path: path.into(),
        message: e.to_string(),
    })
}

/// Refuses YAML flow collections nested deeper than [`MAX_NESTING`].
fn check_depth(text: &str) -> Result<(), String> {
    let mut depth = 0usize;
    for (i, line) in text.lines().enumerate() {
        for c in line.chars() {
            match c {
                '[' | '{' => depth += 1,
                ']' | '}' => depth = depth.saturating_sub(1),
                _ => {}
            }
            if depth > MAX_NESTING {
                return Err(format!(
                    "line {}: nesting deeper than {MAX_NESTING} levels",
                    i + 1
                ));
            }
        }
    }
    Ok(())
}

/// Reads a recipe file: a regular file of at most [`MAX_RECIPE_BYTES`] (a FIFO is refused
/// without waiting for a writer).
fn read_text(path: &Path) -> Result<String, RecipeError> {
    use crate::files::{read_capped, ReadError};
    let parse = |message: String| RecipeError::Parse {
        path: path.into(),
        message,
    };
    let bytes = match read_capped(path, MAX_RECIPE_BYTES) {
        Ok(b) => b,
        Err(ReadError::Io(error)) => {
            return Err(RecipeError::Io {
                path: path.into(),
                error,
            })
        }
        Err(ReadError::NotRegular) => return Err(parse("not a regular file".into())),
        Err(ReadError::TooLarge { .. }) => {
            return Err(parse(format!(
                "larger than {MAX_RECIPE_BYTES} bytes; a recipe is a few kilobytes"
            )))
        }
    };
    String::from_utf8(bytes).map_err(|_| parse("not UTF-8 text".into()))
}

/// Loads `path` (following `inherit:`), applies `overrides` (`a.b=value`, comma-separated lists
/// allowed, YAML values), deserialises and validates it.
pub fn load(path: &Path, overrides: &[String]) -> Result<Recipe, RecipeError> {
    finish(read_with_inherit(path, &mut Vec::new())?, path, overrides)
}

/// Like [`load`] for a complete recipe given as YAML text (e.g. the one stored in a checkpoint);
/// `origin` names it in error messages. `inherit:` is not followed.
pub fn load_str(text: &str, origin: &Path, overrides: &[String]) -> Result<Recipe, RecipeError> {
    finish(parse(text, origin)?, origin, overrides)
}

/// Parses a recipe that an earlier version of this program stored (in a checkpoint's manifest):
/// keys it has since renamed are read as what they meant — `parallel.zero1: true|false` as
/// `parallel.zero: 1|0` — and removed ones (`train.backward`) are dropped, where a user's recipe
/// using them is refused with the reason.
pub fn load_stored(text: &str, origin: &Path, overrides: &[String]) -> Result<Recipe, RecipeError> {
    let mut value = parse(text, origin)?;
    if let Some(train) = value.get_mut("train").and_then(Value::as_mapping_mut) {
        train.remove("backward");
    }
    if let Some(parallel) = value.get_mut("parallel").and_then(Value::as_mapping_mut) {
        if let Some(old) = parallel.remove("zero1") {
            if !parallel.contains_key("zero") {
                let stage = u8::from(old.as_bool() == Some(true));
                parallel.insert("zero".into(), stage.into());
            }
        }
    }
    finish(value, origin, overrides)
}

fn finish(mut value: Value, path: &Path, overrides: &[String]) -> Result<Recipe, RecipeError> {
    let mut applied = Vec::new();
    for arg in overrides {
        for (key, raw) in split_overrides(arg)? {
            check_depth(&raw).map_err(|message| RecipeError::Override {
                arg: arg.clone(),
                message,
            })?;
            let parsed: Value = serde_yaml::from_str(&raw).unwrap_or(Value::String(raw.clone()));
            set_path(&mut value, &key, parsed).map_err(|message| RecipeError::Override {
                arg: arg.clone(),
                message,
            })?;
            applied.push((key, raw));
        }
    }
    let mut recipe: Recipe = serde_path_to_error::deserialize(value).map_err(|e| {
        let (at, message) = (e.path().to_string(), e.inner().to_string());
        // A value that an override set is reported as the override's, the last one that set it.
        match applied
            .iter()
            .rev()
            .find(|(key, _)| sets(key, &at, &message))
        {
            Some((key, raw)) => RecipeError::Override {
                arg: format!("{key}={raw}"),
                message: format!("{at}: {message}"),
            },
            None => RecipeError::Parse {
                path: path.to_path_buf(),
                message: format!("{at}: {message}"),
            },
        }
    })?;
    // Said once per job: by the process of rank 0 (or the only process).
    let first = ["RANK", "SLURM_PROCID"]
        .iter()
        .all(|v| std::env::var(v).map_or(true, |r| r.trim() == "0"));
    for w in recipe.scale_down() {
        if first {
            tracing::warn!("{}: {w}", path.display());
        }
    }
    let problems = recipe.problems();
    if problems.is_empty() {
        Ok(recipe)
    } else {
        Err(RecipeError::Invalid {
            path: path.to_path_buf(),
            problems,
        })
    }
}

/// Parses one YAML file and merges it over the file named by its `inherit:` key (relative to it).
fn read_with_inherit(path: &Path, chain: &mut Vec<PathBuf>) -> Result<Value, RecipeError> {
    // A pipe (process substitution, /dev/stdin) has no path to canonicalize: named as what it
    // is rather than "No such file".
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
        return Err(RecipeError::Parse {
            path: path.into(),
            message: "not a regular file (a pipe, device or directory: process substitution and \
                      /dev/stdin are not read; write the recipe to a file)"
                .into(),
        });
    }
    let canonical = path.canonicalize().map_err(|error| RecipeError::Io {
        path: path.into(),
        error,
    })?;
    if chain.contains(&canonical) {
        return Err(RecipeError::InheritCycle { path: path.into() });
    }
    chain.push(canonical);
    let text = read_text(path)?;
    let mut value = parse(&text, path)?;
    let Value::Mapping(map) = &mut value else {
        return Err(RecipeError::Parse {
            path: path.into(),
            message: "the top level must be a mapping".into(),
        });
    };
    match map.remove("inherit") {
        None => Ok(value),
        Some(Value::String(base)) => {
            let base_path = path.parent().unwrap_or(Path::new(".")).join(base);
            let mut merged = read_with_inherit(&base_path, chain)?;
            merge(&mut merged, value);
            Ok(merged)
        }
        Some(_) => Err(RecipeError::Parse {
            path: path.into(),
            message: "inherit: must be a file path".into(),
        }),
    }
}

/// Deep-merges `over` into `base`: mappings merge key by key, anything else replaces.
fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (slot, v) => *slot = v,
    }
}

/// Whether the override of `key` set what a deserialisation error at `at` (with `message`)
/// names: the key itself (an unknown key's error is at the key), a part of it
/// (`data.datasets[0].prefix` of `data.datasets`), or a section it made up (`bogus` of
/// `bogus.x`, unknown).
fn sets(key: &str, at: &str, message: &str) -> bool {
    let below = |long: &str, short: &str, marks: &[char]| {
        long.strip_prefix(short)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(marks))
    };
    below(at, key, &['.', '[']) || (below(key, at, &['.']) && message.starts_with("unknown field"))
}

/// Splits `a.b=1,c.d=x,y` into `[(a.b, 1), (c.d, "x,y")]`: a comma starts a new override only when
/// what follows looks like `key.path=`.
fn split_overrides(arg: &str) -> Result<Vec<(String, String)>, RecipeError> {
    if arg.ends_with(',') {
        return Err(RecipeError::Override {
            arg: arg.into(),
            message: "ends with a comma, which would become part of the last value; remove it"
                .into(),
        });
    }
    let mut out: Vec<(String, String)> = Vec::new();
    for piece in arg.split(',') {
        // `a=1, b.c=2` sets two keys: the space after the comma is not part of a key.
        let key = piece.split_once('=').map(|(k, _)| k.trim());
        match (key.filter(|k| key_problem(k).is_none()), out.last_mut()) {
            (Some(k), _) => {
                let (_, v) = piece.split_once('=').expect("checked above");
                out.push((k.to_string(), v.to_string()));
            }
            (None, Some(last)) => {
                last.1.push(',');
                last.1.push_str(piece);
            }
            (None, None) => {
                let message = match key {
                    Some(k) => format!("the key `{k}` {}", key_problem(k).expect("refused above")),
                    None => "expected key.path=value (e.g. train.steps=100)".into(),
                };
                return Err(RecipeError::Override {
                    arg: arg.into(),
                    message,
                });
            }
        }
    }
    Ok(out)
}

/// Why `key` (trimmed) cannot be a dotted recipe key, if it cannot.
fn key_problem(key: &str) -> Option<String> {
    if key.is_empty() {
        return Some("is empty: expected key.path=value (e.g. train.steps=100)".into());
    }
    if key.contains('[') {
        return Some(
            "indexes a list, which overrides cannot: set the whole list (e.g. \
             data.datasets=[{prefix: data/a, weight: 1}])"
                .into(),
        );
    }
    if key.split('.').any(str::is_empty) {
        return Some("has an empty part between dots".into());
    }
    let bad = key
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))?;
    let what = match bad {
        c if c.is_whitespace() => "whitespace inside it".to_string(),
        c => format!("`{c}`"),
    };
    Some(format!(
        "has {what}, which no recipe key has (keys are ASCII letters, digits, `_` and dots)"
    ))
}

/// Sets the dotted `key` in `root` to `value`, creating missing mappings.
fn set_path(root: &mut Value, key: &str, value: Value) -> Result<(), String> {
    let mut node = root;
    let parts: Vec<&str> = key.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        let Value::Mapping(map) = node else {
            return Err(format!("`{}` is not a section", parts[..i].join(".")));
        };
        let k = Value::String(part.to_string());
        if i + 1 == parts.len() {
            map.insert(k, value);
            return Ok(());
        }
        node = map
            .entry(k)
            .or_insert_with(|| Value::Mapping(Mapping::new()));
    }
    unreachable!("split always yields at least one part")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_split_on_key_commas_only() {
        let v = split_overrides("parallel.tp=2,parallel.dp=2").unwrap();
        assert_eq!(
            v,
            vec![
                ("parallel.tp".into(), "2".into()),
                ("parallel.dp".into(), "2".into())
            ]
        );
        let v = split_overrides("data.split=98,2").unwrap();
        assert_eq!(v, vec![("data.split".into(), "98,2".into())]);
        let e = split_overrides("train.steps=100,").unwrap_err().to_string();
        assert!(
            e.contains("--set train.steps=100,: ends with a comma"),
            "{e}"
        );
        let e = split_overrides("nonsense").unwrap_err().to_string();
        assert!(
            e.contains("--set nonsense: expected key.path=value (e.g. train.steps=100)"),
            "{e}"
        );
        // A space after a comma does not hide the next override inside the value before it.
        let v = split_overrides("checkpoint.dir=/tmp/x, train.steps=1").unwrap();
        assert_eq!(
            v,
            vec![
                ("checkpoint.dir".into(), "/tmp/x".into()),
                ("train.steps".into(), "1".into())
            ]
        );
        let v = split_overrides("data.split=98, 2").unwrap();
        assert_eq!(v, vec![("data.split".into(), "98, 2".into())]);
        for (arg, says) in [
            (
                "train.st\u{e9}ps=3",
                "the key `train.st\u{e9}ps` has `\u{e9}`",
            ),
            (
                "parallel.p p=2",
                "the key `parallel.p p` has whitespace inside it",
            ),
            ("data.datasets[0].prefix=x", "indexes a list"),
            ("train..steps=3", "has an empty part between dots"),
            ("=3", "the key `` is empty"),
        ] {
            let e = split_overrides(arg).unwrap_err().to_string();
            assert!(e.contains(says), "{arg}: {e}");
        }
    }

    /// A value an override set that does not deserialise is reported against the override,
    /// one the file set against the file.
    #[test]
    fn type_errors_name_the_override_that_set_the_value() {
        let file = Path::new("recipes/tiny.yaml");
        let err = |set: &[&str]| {
            let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
            load(file, &set).unwrap_err().to_string()
        };
        let cases: [(&[&str], &str); 6] = [
            (
                &["train.steps=abc"],
                "--set train.steps=abc: train.steps: invalid type",
            ),
            (
                &["train.steps=1", "train.steps=abc,optimizer.lr=1e-3"],
                "--set train.steps=abc: train.steps:",
            ),
            (
                &["data.datasets=[{prefix: 3, weight: x}]"],
                "--set data.datasets=[{prefix: 3, weight: x}]: data.datasets[0]",
            ),
            (
                &["train.stepz=5"],
                "--set train.stepz=5: train.stepz: unknown field `stepz`",
            ),
            (
                &["bogus.x=1"],
                "--set bogus.x=1: bogus: unknown field `bogus`",
            ),
            (&["stray=5"], "--set stray=5: stray: unknown field `stray`"),
        ];
        for (set, expected) in cases {
            let e = err(set);
            assert!(e.starts_with(expected), "{e}");
        }
        // Nothing set by an override: the file is named.
        let text = std::fs::read_to_string(file).unwrap();
        let bad = text.replacen("steps: 200", "steps: abc", 1);
        let e = load_str(&bad, file, &["optimizer.lr=1e-3".into()])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("recipes/tiny.yaml: "), "{e}");
    }

    #[test]
    fn merge_is_deep() {
        let mut a: Value = serde_yaml::from_str("x: {a: 1, b: 2}\ny: 3").unwrap();
        merge(&mut a, serde_yaml::from_str("x: {b: 5}\nz: 1").unwrap());
        assert_eq!(
            a,
            serde_yaml::from_str::<Value>("x: {a: 1, b: 5}\ny: 3\nz: 1").unwrap()
        );
    }
}
