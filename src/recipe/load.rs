//! Reading a recipe: YAML parsing, `inherit:` chains, `--set` overrides, typed deserialisation.

use std::path::{Path, PathBuf};

use serde_yaml::{Mapping, Value};

use super::Recipe;

/// Why a recipe could not be used.
#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
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

/// Loads `path` (following `inherit:`), applies `overrides` (`a.b=value`, comma-separated lists
/// allowed, YAML values), deserialises and validates it.
pub fn load(path: &Path, overrides: &[String]) -> Result<Recipe, RecipeError> {
    finish(read_with_inherit(path, &mut Vec::new())?, path, overrides)
}

/// Like [`load`] for a complete recipe given as YAML text (e.g. the one stored in a checkpoint);
/// `origin` names it in error messages. `inherit:` is not followed.
pub fn load_str(text: &str, origin: &Path, overrides: &[String]) -> Result<Recipe, RecipeError> {
    let value: Value = serde_yaml::from_str(text).map_err(|e| RecipeError::Parse {
        path: origin.into(),
        message: e.to_string(),
    })?;
    finish(value, origin, overrides)
}

/// Parses a recipe that an earlier version of this program stored (in a checkpoint's manifest):
/// keys it has since renamed are read as what they meant — `parallel.zero1: true|false` as
/// `parallel.zero: 1|0` — where a user's recipe using them is refused with the new name.
pub fn load_stored(text: &str, origin: &Path, overrides: &[String]) -> Result<Recipe, RecipeError> {
    let mut value: Value = serde_yaml::from_str(text).map_err(|e| RecipeError::Parse {
        path: origin.into(),
        message: e.to_string(),
    })?;
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
    for arg in overrides {
        for (key, raw) in split_overrides(arg)? {
            let parsed: Value = serde_yaml::from_str(&raw).unwrap_or(Value::String(raw.clone()));
            set_path(&mut value, &key, parsed).map_err(|message| RecipeError::Override {
                arg: arg.clone(),
                message,
            })?;
        }
    }
    let recipe: Recipe =
        serde_path_to_error::deserialize(value).map_err(|e| RecipeError::Parse {
            path: path.to_path_buf(),
            message: format!("{}: {}", e.path(), e.inner()),
        })?;
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
    let canonical = path.canonicalize().map_err(|source| RecipeError::Io {
        path: path.into(),
        source,
    })?;
    if chain.contains(&canonical) {
        return Err(RecipeError::InheritCycle { path: path.into() });
    }
    chain.push(canonical);
    let text = std::fs::read_to_string(path).map_err(|source| RecipeError::Io {
        path: path.into(),
        source,
    })?;
    let mut value: Value = serde_yaml::from_str(&text).map_err(|e| RecipeError::Parse {
        path: path.into(),
        message: e.to_string(),
    })?;
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

/// Splits `a.b=1,c.d=x,y` into `[(a.b, 1), (c.d, "x,y")]`: a comma starts a new override only when
/// what follows looks like `key.path=`.
fn split_overrides(arg: &str) -> Result<Vec<(String, String)>, RecipeError> {
    let mut out: Vec<(String, String)> = Vec::new();
    for piece in arg.split(',') {
        let starts_override = piece.split_once('=').is_some_and(|(k, _)| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        });
        match (starts_override, out.last_mut()) {
            (true, _) => {
                let (k, v) = piece.split_once('=').expect("checked above");
                out.push((k.to_string(), v.to_string()));
            }
            (false, Some(last)) => {
                last.1.push(',');
                last.1.push_str(piece);
            }
            (false, None) => {
                return Err(RecipeError::Override {
                    arg: arg.into(),
                    message: "expected key.path=value (e.g. train.steps=100)".into(),
                })
            }
        }
    }
    Ok(out)
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
        assert!(split_overrides("nonsense").is_err());
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
