//! Defines the streaming readers of text ([`TextDocs`]) and JSON Lines ([`JsonlDocs`])
//! documents over any byte stream (a file or a decompressor).

use std::collections::VecDeque;
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use super::MAX_DOCUMENT_BYTES;
use crate::error::{DataError, Result};

/// Bytes asked of the stream at a time.
const READ_BYTES: usize = 1 << 20;

/// Text documents: the stream split at a separator (pieces that are only whitespace are
/// dropped), or the whole stream as one document. At most one document plus one read is held.
pub(super) struct TextDocs<R> {
    reader: R,
    path: PathBuf,
    separator: Option<Vec<u8>>,
    /// Bytes read and not yet handed out; `buf[0]` is byte `offset` of the stream.
    buf: Vec<u8>,
    offset: u64,
    /// Where the next separator search starts in `buf`.
    search: usize,
    ready: VecDeque<String>,
    eof: bool,
    done: bool,
}

impl<R: Read> TextDocs<R> {
    /// Documents of `reader`, the stream of `path` from byte `offset` on (past a byte-order
    /// mark), split at `separator`.
    pub(super) fn new(reader: R, path: &Path, separator: Option<&str>, offset: u64) -> Self {
        TextDocs {
            reader,
            path: path.to_path_buf(),
            separator: separator
                .filter(|s| !s.is_empty())
                .map(|s| s.as_bytes().to_vec()),
            buf: Vec::new(),
            offset,
            search: 0,
            ready: VecDeque::new(),
            eof: false,
            done: false,
        }
    }

    fn error(&self, at: u64, message: String) -> DataError {
        DataError::corrupt(&self.path, format!("byte {at}"), message)
    }

    /// Queues `buf[start..end]` as a document unless it is only whitespace.
    fn queue(&mut self, start: usize, end: usize) -> Result<()> {
        let piece = &self.buf[start..end];
        let text = std::str::from_utf8(piece).map_err(|e| {
            self.error(
                self.offset + (start + e.valid_up_to()) as u64,
                "invalid UTF-8".into(),
            )
        })?;
        if !text.trim().is_empty() {
            self.ready.push_back(text.to_owned());
        }
        Ok(())
    }

    /// Reads more of the stream, queueing the documents it completes.
    fn fill(&mut self) -> Result<()> {
        let had = self.buf.len();
        self.buf.resize(had + READ_BYTES, 0);
        let n = loop {
            match self.reader.read(&mut self.buf[had..]) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.buf.truncate(had);
                    return Err(self.error(self.offset + had as u64, e.to_string()));
                }
            }
        };
        self.buf.truncate(had + n);
        self.eof = n == 0;
        let mut start = 0;
        if let Some(sep) = self.separator.clone() {
            while let Some(i) = find(&self.buf[self.search..], &sep) {
                let end = self.search + i;
                self.queue(start, end)?;
                start = end + sep.len();
                self.search = start;
            }
            self.search = self.buf.len().saturating_sub(sep.len() - 1).max(start);
        }
        if self.eof {
            self.queue(start, self.buf.len())?;
            start = self.buf.len();
        } else if self.buf.len() - start > MAX_DOCUMENT_BYTES {
            return Err(self.error(
                self.offset + start as u64,
                format!(
                    "a document longer than {MAX_DOCUMENT_BYTES} bytes starts here{}",
                    if self.separator.is_some() {
                        " (is the separator right?)"
                    } else {
                        "; split the file with --doc-separator"
                    }
                ),
            ));
        }
        self.buf.drain(..start);
        self.search -= start.min(self.search);
        self.offset += start as u64;
        Ok(())
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

impl<R: Read> Iterator for TextDocs<R> {
    type Item = Result<String>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(doc) = self.ready.pop_front() {
                return Some(Ok(doc));
            }
            if self.done || self.eof {
                return None;
            }
            if let Err(e) = self.fill() {
                self.done = true;
                return Some(Err(e));
            }
        }
    }
}

/// JSON Lines documents: the string field `key` of each non-blank line.
pub(super) struct JsonlDocs<R> {
    reader: R,
    path: PathBuf,
    key: String,
    line: usize,
    done: bool,
    bytes: Vec<u8>,
}

impl<R: BufRead> JsonlDocs<R> {
    pub(super) fn new(reader: R, path: &Path, key: &str) -> Self {
        JsonlDocs {
            reader,
            path: path.to_path_buf(),
            key: key.to_string(),
            line: 0,
            done: false,
            bytes: Vec::new(),
        }
    }

    fn error(&self, message: String) -> DataError {
        DataError::Jsonl {
            path: self.path.clone(),
            line: self.line,
            message,
        }
    }

    /// The next line's document: `Ok(None)` at the end, `Ok(Some(None))` for a blank line.
    fn next_line(&mut self) -> Result<Option<Option<String>>> {
        self.bytes.clear();
        self.line += 1;
        let limit = MAX_DOCUMENT_BYTES as u64 + 1;
        let n = (&mut self.reader)
            .take(limit)
            .read_until(b'\n', &mut self.bytes)
            .map_err(|e| self.error(format!("cannot read line: {e}")))?;
        if n == 0 {
            return Ok(None);
        }
        if n as u64 == limit && self.bytes.last() != Some(&b'\n') {
            return Err(self.error(format!("line longer than {MAX_DOCUMENT_BYTES} bytes")));
        }
        let text = std::str::from_utf8(&self.bytes).map_err(|e| {
            self.error(format!(
                "invalid UTF-8 at byte {} of the line",
                e.valid_up_to()
            ))
        })?;
        parse_jsonl_line(text, &self.key)
            .map_err(|m| self.error(m))
            .map(Some)
    }
}

impl<R: BufRead> Iterator for JsonlDocs<R> {
    type Item = Result<String>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            match self.next_line() {
                Ok(None) => self.done = true,
                Ok(Some(None)) => continue,
                Ok(Some(Some(doc))) => return Some(Ok(doc)),
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
        None
    }
}

/// The string field `key` of one JSONL line; blank lines give `None`.
fn parse_jsonl_line(text: &str, key: &str) -> Result<Option<String>, String> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    let obj = value.as_object().ok_or("expected a JSON object")?;
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
            Err(format!("field `{key}` is {kind}, expected a string"))
        }
        None => Err(format!("missing field `{key}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &[u8], sep: Option<&str>, read: usize) -> Result<Vec<String>> {
        /// Hands out at most `read` bytes per call, to cut separators across reads.
        struct Dribble<'a>(&'a [u8], usize);
        impl Read for Dribble<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = self.0.len().min(self.1).min(buf.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        TextDocs::new(Dribble(text, read), Path::new("t.txt"), sep, 0).collect()
    }

    /// The streamed split equals `str::split` with whitespace-only pieces dropped, for
    /// separators cut across reads of every size.
    #[test]
    fn streamed_split_equals_the_whole_texts_split() {
        let text = "a\n\n\n\nb\n\n\nc\n\n\n\n\n\n  \n\n\nd ✓\n\n";
        for sep in ["\n\n\n", "\n", "✓", "xyz"] {
            let want: Vec<String> = text
                .split(sep)
                .filter(|d| !d.trim().is_empty())
                .map(str::to_owned)
                .collect();
            for read in [1, 2, 3, 5, 64] {
                assert_eq!(split(text.as_bytes(), Some(sep), read).unwrap(), want);
            }
        }
        assert_eq!(split(b"whole", None, 2).unwrap(), vec!["whole"]);
        assert!(split(b" \n", None, 1).unwrap().is_empty());
        assert!(split(b"", Some("\n"), 1).unwrap().is_empty());
    }

    #[test]
    fn invalid_utf8_names_the_byte() {
        let e = split(b"ok\n\nbad \xff here", Some("\n\n"), 3).unwrap_err();
        assert!(
            e.to_string().contains("t.txt: byte 8: invalid UTF-8"),
            "{e}"
        );
    }
}
