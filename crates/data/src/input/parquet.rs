//! Defines [`ParquetDocs`], the documents of a Parquet file: one per row, from a string column
//! (top level, or a dotted path into structs), read with the Apache Arrow project's `parquet`
//! crate a batch of rows at a time, row group after row group. Memory holds one batch (of about
//! [`BATCH_BYTES`], its row count following the documents' sizes) and the page being decoded,
//! whatever the file's size.

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};

use parquet::basic::Type as PhysicalType;
use parquet::column::reader::{ColumnReader, ColumnReaderImpl};
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::reader::{FileReader, SerializedFileReader};

use super::{MAX_DOCUMENT_BYTES, MAX_EXPANSION};
use crate::error::{DataError, Result};

/// Most rows decoded at a time.
const BATCH_ROWS: usize = 1024;

/// Bytes of text a batch aims at: after each batch the next one's row count is set from the
/// documents' mean size so far (starting from 16 rows), so a column of huge documents is read a
/// few at a time.
const BATCH_BYTES: usize = 32 << 20;

/// The documents of one Parquet file; see the module docs.
pub(super) struct ParquetDocs {
    file: SerializedFileReader<File>,
    path: PathBuf,
    key: String,
    column: usize,
    /// 0 when the column cannot be null.
    max_def: i16,
    /// The next row group to open.
    group: usize,
    reader: Option<ColumnReaderImpl<ByteArrayType>>,
    /// Index in the file of the next row decoded.
    row: u64,
    /// Bytes of text read so far (for the batch size).
    text_bytes: u64,
    ready: VecDeque<String>,
    done: bool,
}

impl ParquetDocs {
    /// Opens `path`, finds the string column `key` and checks each row group's compression
    /// ratio (see [`MAX_EXPANSION`]).
    pub(super) fn open(path: &Path, key: &str) -> Result<Self> {
        let f = File::open(path).map_err(|e| DataError::io(path, e))?;
        let corrupt = |at: &str, message: String| DataError::corrupt(path, at, message);
        let file = SerializedFileReader::new(f).map_err(|e| {
            corrupt(
                "footer",
                format!("not a Parquet file, or truncated or damaged: {e}"),
            )
        })?;
        let meta = file.metadata();
        let schema = meta.file_metadata().schema_descr();
        let names: Vec<String> = schema.columns().iter().map(|c| c.path().string()).collect();
        let column = names.iter().position(|n| n == key).ok_or_else(|| {
            let inside = format!("{key}.");
            let nested: Vec<&str> = names
                .iter()
                .filter(|n| n.starts_with(&inside))
                .map(String::as_str)
                .collect();
            let message = if nested.is_empty() {
                format!(
                    "no column `{key}` (--json-key); the columns are: {}",
                    names.join(", ")
                )
            } else {
                format!(
                    "column `{key}` is nested (a list or struct, stored as {}), not one string \
                     per row; --json-key can name a struct's string field as `a.b`",
                    nested.join(", ")
                )
            };
            DataError::Input {
                input: path.display().to_string(),
                message,
            }
        })?;
        let descr = schema.column(column);
        if descr.physical_type() != PhysicalType::BYTE_ARRAY || descr.max_rep_level() > 0 {
            return Err(DataError::Input {
                input: path.display().to_string(),
                message: format!(
                    "column `{key}` holds {}{}, not one string per row",
                    if descr.max_rep_level() > 0 {
                        "lists of "
                    } else {
                        ""
                    },
                    descr.physical_type()
                ),
            });
        }
        for (g, group) in meta.row_groups().iter().enumerate() {
            let chunk = group.column(column);
            let (packed, unpacked) = (chunk.compressed_size(), chunk.uncompressed_size());
            if unpacked > 0 && unpacked as u64 > MAX_EXPANSION * packed.max(1 << 20) as u64 {
                return Err(corrupt(
                    &format!("row group {g}"),
                    format!(
                        "column `{key}` says {packed} bytes decompress to {unpacked}, over \
                         {MAX_EXPANSION}x (a decompression bomb?)"
                    ),
                ));
            }
        }
        Ok(ParquetDocs {
            file,
            path: path.to_path_buf(),
            key: key.to_string(),
            column,
            max_def: descr.max_def_level(),
            group: 0,
            reader: None,
            row: 0,
            text_bytes: 0,
            ready: VecDeque::new(),
            done: false,
        })
    }

    fn error(&self, row: u64, message: String) -> DataError {
        DataError::corrupt(&self.path, format!("row {row}"), message)
    }

    /// Decodes the next batch of rows into `ready`; `false` at the end of the file.
    fn fill(&mut self) -> Result<bool> {
        let batch = match self.text_bytes / self.row.max(1) {
            _ if self.row == 0 => 16,
            mean => (BATCH_BYTES as u64 / mean.max(1)).clamp(1, BATCH_ROWS as u64) as usize,
        };
        let mut defs = Vec::with_capacity(batch);
        let mut values: Vec<ByteArray> = Vec::with_capacity(batch);
        loop {
            let Some(reader) = self.reader.as_mut() else {
                if self.group == self.file.num_row_groups() {
                    return Ok(false);
                }
                let g = self.group;
                self.group += 1;
                let column = self
                    .file
                    .get_row_group(g)
                    .and_then(|group| group.get_column_reader(self.column))
                    .map_err(|e| self.error(self.row, format!("row group {g}: {e}")))?;
                match column {
                    ColumnReader::ByteArrayColumnReader(r) => self.reader = Some(r),
                    _ => return Err(self.error(self.row, "column type changed".into())),
                }
                continue;
            };
            let defs_out = (self.max_def > 0).then_some(&mut defs);
            let (rows, _, _) = reader
                .read_records(batch, defs_out, None, &mut values)
                .map_err(|e| {
                    let at = format!("row {} (row group {})", self.row, self.group - 1);
                    DataError::corrupt(&self.path, at, e.to_string())
                })?;
            if rows == 0 {
                self.reader = None;
                continue;
            }
            if self.max_def > 0 {
                if let Some(r) = defs[..rows].iter().position(|&d| d < self.max_def) {
                    let row = self.row + r as u64;
                    return Err(self.error(row, format!("column `{}` is null", self.key)));
                }
            }
            let mut values = values.drain(..);
            for r in 0..rows {
                let row = self.row + r as u64;
                let value = values
                    .next()
                    .ok_or_else(|| self.error(row, "fewer values than rows".into()))?;
                if value.len() > MAX_DOCUMENT_BYTES {
                    let len = value.len();
                    let what = format!("a document of {len} bytes, over {MAX_DOCUMENT_BYTES}");
                    return Err(self.error(row, what));
                }
                self.text_bytes += value.len() as u64;
                let text = std::str::from_utf8(value.data()).map_err(|e| {
                    self.error(
                        row,
                        format!(
                            "invalid UTF-8 at byte {} of `{}`",
                            e.valid_up_to(),
                            self.key
                        ),
                    )
                })?;
                self.ready.push_back(text.to_owned());
            }
            self.row += rows as u64;
            return Ok(true);
        }
    }
}

impl Iterator for ParquetDocs {
    type Item = Result<String>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(doc) = self.ready.pop_front() {
                return Some(Ok(doc));
            }
            if self.done {
                return None;
            }
            match self.fill() {
                Ok(true) => {}
                Ok(false) => self.done = true,
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
    }
}
