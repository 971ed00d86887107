//! Defines how preprocessing finds its input files ([`expand_inputs`]) and turns each file
//! into documents ([`read_documents`]).
//!
//! The form of a file is read from its name ([`input_kind`]):
//! * `.txt` / `.text`: the whole file is one document, or, with a separator, the file is
//!   split at every occurrence of the separator string; empty pieces are dropped.
//! * `.jsonl`: one JSON object per non-blank line; the document is the string in the
//!   configured field. Errors name the file and the 1-based line.
//! * either of those compressed: `.gz` (gzip; concatenated members as `pigz`/`bgzip` write
//!   them) or `.zst` / `.zstd` (zstandard; several frames too), e.g. `part.jsonl.zst`.
//! * `.parquet`: one document per row, from the string column named like the JSON field
//!   (a dotted path reaches into a struct), read a batch of rows at a time.
//!
//! Every form is streamed, so memory does not grow with the file: it holds one batch of
//! documents and at most [`MAX_DOCUMENT_BYTES`] of a document being read. A damaged file is an
//! error naming the file and where: the line, the row, or the byte offset.

mod compressed;
mod parquet;
mod text;

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use crate::error::{DataError, Result};

pub use compressed::MAX_EXPANSION;

/// Longest document (or JSONL line) read: a text without its separator, or a line without its
/// newline, longer than this is an error rather than a reason to fill memory.
pub const MAX_DOCUMENT_BYTES: usize = 1 << 30;

/// Resolves files and glob patterns into a sorted, de-duplicated list of files. Every
/// pattern must match at least one file, and every file must be of a known form.
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
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some("no such file"),
                Err(e) => {
                    return Err(DataError::Input {
                        input: input.clone(),
                        message: format!("cannot read it: {e}"),
                    })
                }
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
    let listed = files.len();
    // One file under two names (`a.jsonl`, `./a.jsonl`, a link) is one file.
    let mut seen = std::collections::HashSet::new();
    files.retain(|f| seen.insert(std::fs::canonicalize(f).unwrap_or_else(|_| f.clone())));
    if files.len() < listed {
        tracing::warn!(
            "{} input file(s) matched more than once are read once (to weight a dataset, give it \
             a weight in the recipe's data.datasets)",
            listed - files.len()
        );
    }
    for f in &files {
        input_kind(f)?;
    }
    Ok(files)
}

/// How the documents are laid out in a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Plain text.
    Text,
    /// JSON Lines.
    Jsonl,
    /// Apache Parquet.
    Parquet,
}

/// How a text or JSONL file is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Not compressed.
    None,
    /// gzip (`.gz`).
    Gzip,
    /// zstandard (`.zst`, `.zstd`).
    Zstd,
}

/// The form of an input file, from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputKind {
    /// Layout of the documents.
    pub format: Format,
    /// Compression around them (always `None` for Parquet, which compresses inside).
    pub compression: Compression,
}

const FORMS: &str = ".txt, .text, .jsonl (each optionally .gz, .zst or .zstd) or .parquet";

/// Classifies a file by its name: `[.txt|.text|.jsonl][.gz|.zst|.zstd]` or `.parquet`.
pub fn input_kind(path: &Path) -> Result<InputKind> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let (stem, compression) = if let Some(s) = name.strip_suffix(".gz") {
        (s, Compression::Gzip)
    } else if let Some(s) = name
        .strip_suffix(".zst")
        .or_else(|| name.strip_suffix(".zstd"))
    {
        (s, Compression::Zstd)
    } else {
        (name, Compression::None)
    };
    let format = match Path::new(stem).extension().and_then(|e| e.to_str()) {
        Some("txt") | Some("text") => Format::Text,
        Some("jsonl") => Format::Jsonl,
        Some("parquet") if compression == Compression::None => Format::Parquet,
        Some("parquet") => {
            return Err(DataError::Input {
                input: path.display().to_string(),
                message: "a Parquet file compresses its pages itself: pass the .parquet file, \
                          not a compressed copy of it"
                    .into(),
            })
        }
        _ => {
            return Err(DataError::Input {
                input: path.display().to_string(),
                message: format!("unsupported file name (expected {FORMS})"),
            })
        }
    };
    Ok(InputKind {
        format,
        compression,
    })
}

/// Iterates over the documents of one input file: `json_key` names the JSONL field or the
/// Parquet column; `separator` splits text files (none: a text file is one document). The
/// iterator stops after its first error.
pub fn read_documents(
    path: &Path,
    json_key: &str,
    separator: Option<&str>,
) -> Result<Box<dyn Iterator<Item = Result<String>> + Send>> {
    let kind = input_kind(path)?;
    if kind.format == Format::Parquet {
        return Ok(Box::new(parquet::ParquetDocs::open(path, json_key)?));
    }
    let file = File::open(path).map_err(|e| DataError::io(path, e))?;
    let stream = compressed::open(file, path, kind.compression)?;
    let mut reader = BufReader::with_capacity(1 << 20, stream);
    let bom =
        skip_bom(&mut reader).map_err(|e| DataError::corrupt(path, "byte 0", e.to_string()))?;
    Ok(match kind.format {
        Format::Jsonl => Box::new(text::JsonlDocs::new(reader, path, json_key)),
        _ => Box::new(text::TextDocs::new(reader, path, separator, bom)),
    })
}

/// The UTF-8 byte-order mark some editors and exporters put first in a file.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Consumes a UTF-8 byte-order mark at the start of `reader` (as Python's `utf-8-sig` does);
/// returns the bytes skipped (0 or 3).
fn skip_bom(reader: &mut impl BufRead) -> std::io::Result<u64> {
    if reader.fill_buf()?.starts_with(BOM) {
        reader.consume(BOM.len());
        return Ok(BOM.len() as u64);
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One file named twice (another spelling of its path, a link to it) is read once.
    #[test]
    fn a_file_under_two_names_is_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.jsonl");
        std::fs::write(&a, "{\"text\": \"x\"}\n").unwrap();
        let link = dir.path().join("b.jsonl");
        std::os::unix::fs::symlink(&a, &link).unwrap();
        let other = dir.path().join(".").join("a.jsonl");
        let names = [&a, &other, &link].map(|p| p.display().to_string());
        assert_eq!(expand_inputs(&names).unwrap(), [a]);
    }

    #[test]
    fn names_give_the_form() {
        let kind = |n: &str| input_kind(Path::new(n)).map(|k| (k.format, k.compression));
        use Compression as C;
        use Format as F;
        assert_eq!(kind("a/b.txt").unwrap(), (F::Text, C::None));
        assert_eq!(kind("b.text.gz").unwrap(), (F::Text, C::Gzip));
        assert_eq!(kind("x.y.jsonl.zst").unwrap(), (F::Jsonl, C::Zstd));
        assert_eq!(kind("x.jsonl.zstd").unwrap(), (F::Jsonl, C::Zstd));
        assert_eq!(kind("train-00001.parquet").unwrap(), (F::Parquet, C::None));
        for bad in ["x.json", "x.gz", "x.csv.zst", "x.parquet.gz", "noext"] {
            let e = kind(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
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
