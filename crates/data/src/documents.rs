//! Defines how preprocessing finds its input files ([`expand_inputs`]) and turns each file
//! into documents ([`read_documents`]).
//!
//! * `.txt` (and `.text`): the whole file is one document, or, with a separator, the file is
//!   split at every occurrence of the separator string; empty pieces are dropped.
//! * `.jsonl`: one JSON object per non-blank line; the document is the string in the
//!   configured field. Errors name the file and the 1-based line.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use crate::error::{DataError, Result};

/// Resolves files and glob patterns into a sorted, de-duplicated list of files. Every
/// pattern must match at least one file.
pub fn expand_inputs(inputs: &[String]) -> Result<Vec<PathBuf>> {
    if inputs.is_empty() {
        return Err(DataError::config(
            "inputs",
            "at least one input file or glob is required",
        ));
    }
    let mut files = Vec::new();
    for input in inputs {
        let is_pattern = input.contains(['*', '?', '[']);
        if !is_pattern {
            let p = PathBuf::from(input);
            let problem = match std::fs::metadata(&p) {
                Ok(m) if m.is_file() => None,
                Ok(m) if m.is_dir() => Some("a directory, not a file (use a glob: DIR/*.txt)"),
                Ok(_) => Some("not a regular file (a device, FIFO or socket)"),
                Err(_) => Some("no such file"),
            };
            if let Some(message) = problem {
                return Err(DataError::Input {
                    input: input.clone(),
                    message: message.into(),
                });
            }
            files.push(p);
            continue;
        }
        let paths = glob::glob(input).map_err(|e| DataError::Input {
            input: input.clone(),
            message: format!("bad glob pattern: {e}"),
        })?;
        let mut matched = 0;
        for entry in paths {
            let p = entry.map_err(|e| DataError::Input {
                input: input.clone(),
                message: format!("cannot read {}: {}", e.path().display(), e.error()),
            })?;
            if p.is_file() {
                files.push(p);
                matched += 1;
            }
        }
        if matched == 0 {
            return Err(DataError::Input {
                input: input.clone(),
                message: "pattern matched no files".into(),
            });
        }
    }
    files.sort();
    files.dedup();
    for f in &files {
        input_kind(f)?;
    }
    Ok(files)
}

/// The two supported input formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputKind {
    /// Plain text.
    Text,
    /// JSON Lines.
    Jsonl,
}

/// Classifies a file by extension (`.txt`/`.text` or `.jsonl`).
pub fn input_kind(path: &Path) -> Result<InputKind> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("txt") | Some("text") => Ok(InputKind::Text),
        Some("jsonl") => Ok(InputKind::Jsonl),
        _ => Err(DataError::Input {
            input: path.display().to_string(),
            message: "unsupported extension (expected .txt, .text or .jsonl)".into(),
        }),
    }
}

/// Iterates over the documents of one input file. Text files are read whole; JSONL files
/// are streamed line by line, so their size is not limited by memory.
pub fn read_documents(
    path: &Path,
    json_key: &str,
    separator: Option<&str>,
) -> Result<Box<dyn Iterator<Item = Result<String>> + Send>> {
    match input_kind(path)? {
        InputKind::Text => {
            let text = std::fs::read_to_string(path).map_err(|e| DataError::io(path, e))?;
            Ok(Box::new(split_text(text, separator).into_iter().map(Ok)))
        }
        InputKind::Jsonl => {
            let file = File::open(path).map_err(|e| DataError::io(path, e))?;
            Ok(Box::new(JsonlDocs {
                reader: BufReader::with_capacity(1 << 20, file),
                path: path.to_path_buf(),
                key: json_key.to_string(),
                line: 0,
                done: false,
            }))
        }
    }
}

fn split_text(text: String, separator: Option<&str>) -> Vec<String> {
    match separator {
        Some(sep) if !sep.is_empty() => text
            .split(sep)
            .filter(|d| !d.trim().is_empty())
            .map(str::to_owned)
            .collect(),
        _ if text.trim().is_empty() => Vec::new(),
        _ => vec![text],
    }
}

/// Streaming JSONL document reader; stops after the first error.
struct JsonlDocs {
    reader: BufReader<File>,
    path: PathBuf,
    key: String,
    line: usize,
    done: bool,
}

impl Iterator for JsonlDocs {
    type Item = Result<String>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut buf = String::new();
        while !self.done {
            buf.clear();
            self.line += 1;
            match self.reader.read_line(&mut buf) {
                Ok(0) => self.done = true,
                Ok(_) => match parse_jsonl_line(&self.path, self.line, &buf, &self.key) {
                    Ok(None) => continue,
                    Ok(Some(doc)) => return Some(Ok(doc)),
                    Err(e) => {
                        self.done = true;
                        return Some(Err(e));
                    }
                },
                Err(e) => {
                    self.done = true;
                    let message = format!("cannot read line: {e}");
                    return Some(Err(DataError::Jsonl {
                        path: self.path.clone(),
                        line: self.line,
                        message,
                    }));
                }
            }
        }
        None
    }
}

/// Parses one JSONL line (1-based `line`); blank lines give `None`.
fn parse_jsonl_line(path: &Path, line: usize, text: &str, key: &str) -> Result<Option<String>> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let err = |message: String| DataError::Jsonl {
        path: path.to_path_buf(),
        line,
        message,
    };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| err(format!("invalid JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| err("expected a JSON object".into()))?;
    match obj.get(key) {
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => {
            let kind = match other {
                serde_json::Value::Null => "null",
                serde_json::Value::Bool(_) => "a boolean",
                serde_json::Value::Number(_) => "a number",
                serde_json::Value::Array(_) => "an array",
                _ => "an object",
            };
            Err(err(format!("field `{key}` is {kind}, expected a string")))
        }
        None => Err(err(format!("missing field `{key}`"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separator_splits_and_drops_empty_pieces() {
        let docs = split_text("a\n\n\nb\n\n\n\n\n\n".into(), Some("\n\n\n"));
        assert_eq!(docs, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(split_text("whole".into(), None), vec!["whole".to_string()]);
        assert!(split_text(" \n".into(), None).is_empty());
    }

    #[test]
    fn jsonl_errors_name_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.jsonl");
        let read = |text: &str, key: &str| -> Result<Vec<String>> {
            std::fs::write(&p, text).unwrap();
            read_documents(&p, key, None)?.collect()
        };
        let e = read("{\"text\": \"a\"}\n\n{\"body\": \"b\"}\n", "text")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x.jsonl:3") && e.contains("missing field `text`"),
            "{e}"
        );
        let e = read("{\"text\": 5}", "text").unwrap_err().to_string();
        assert!(e.contains("x.jsonl:1") && e.contains("a number"), "{e}");
        let e = read("not json", "text").unwrap_err().to_string();
        assert!(e.contains("invalid JSON"), "{e}");
        assert_eq!(
            read("{\"body\":\"b\"}\r\n{\"body\":\"c\"}", "body").unwrap(),
            vec!["b", "c"]
        );
    }
}
