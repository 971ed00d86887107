//! Defines the Megatron-LM indexed dataset format (`.bin` + `.idx`): [`DType`] codes, the
//! layout constants, and [`IndexedDatasetWriter`], which writes files byte-compatible with
//! Megatron's `megatron/core/datasets/indexed_dataset.py`.
//!
//! Layout of `P.idx` (all integers little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 9 | magic `MMIDIDX\x00\x00` |
//! | 8 | version, u64 = 1 |
//! | 1 | dtype code, u8 (see [`DType`]) |
//! | 8 | sequence count N, u64 |
//! | 8 | document count D, u64 (= documents + 1: the document indices start with 0) |
//! | 4·N | sequence lengths in tokens, i32 |
//! | 8·N | sequence pointers: byte offsets into `P.bin`, i64 |
//! | 8·D | document indices: sequence index where each document starts, then N, i64 |
//!
//! `P.bin` is the concatenation of all sequences' tokens in the dtype. This crate writes one
//! sequence per document, so the document indices are `0, 1, …, N`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::{DataError, Result};

/// The 9 magic bytes that start every `.idx` file.
pub const IDX_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The only `.idx` version in existence.
pub const IDX_VERSION: u64 = 1;
/// Length of the fixed header: magic, version, dtype code, sequence count, document count.
pub const IDX_HEADER_LEN: u64 = 9 + 8 + 1 + 8 + 8;

/// Element types of the `.bin` file, with Megatron's numeric codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// Code 1.
    U8,
    /// Code 2.
    I8,
    /// Code 3.
    I16,
    /// Code 4.
    I32,
    /// Code 5.
    I64,
    /// Code 6.
    F64,
    /// Code 7.
    F32,
    /// Code 8.
    U16,
}

impl DType {
    /// Megatron's numeric code for this dtype.
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::I16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::F64 => 6,
            DType::F32 => 7,
            DType::U16 => 8,
        }
    }

    /// The dtype for a Megatron code, `None` for unknown codes.
    pub fn from_code(code: u8) -> Option<DType> {
        Some(match code {
            1 => DType::U8,
            2 => DType::I8,
            3 => DType::I16,
            4 => DType::I32,
            5 => DType::I64,
            6 => DType::F64,
            7 => DType::F32,
            8 => DType::U16,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// NumPy-style name (`uint16`, `int32`, …).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F64 => "float64",
            DType::F32 => "float32",
            DType::U16 => "uint16",
        }
    }

    /// Largest token id the dtype can store, `None` for float dtypes.
    pub fn max_token(self) -> Option<u64> {
        match self {
            DType::U8 => Some(u8::MAX as u64),
            DType::I8 => Some(i8::MAX as u64),
            DType::I16 => Some(i16::MAX as u64),
            DType::U16 => Some(u16::MAX as u64),
            DType::I32 => Some(i32::MAX as u64),
            DType::I64 => Some(u32::MAX as u64),
            DType::F32 | DType::F64 => None,
        }
    }

    /// Megatron's choice of token dtype: `uint16` when the vocabulary has fewer than 65500
    /// entries, `int32` otherwise.
    pub fn for_vocab_size(vocab_size: usize) -> DType {
        if vocab_size < 65_500 {
            DType::U16
        } else {
            DType::I32
        }
    }
}

/// `prefix` + `.bin`.
pub fn bin_path(prefix: &Path) -> PathBuf {
    with_suffix(prefix, ".bin")
}

/// `prefix` + `.idx`.
pub fn idx_path(prefix: &Path) -> PathBuf {
    with_suffix(prefix, ".idx")
}

fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// A new file at `path`, for writing: a leftover of a process of this id that died is removed
/// first, and a file or link planted there since is refused (`O_CREAT | O_EXCL` never follows a
/// link), so neither another run's file nor a link's target is ever written through.
pub(crate) fn create_fresh(path: &Path) -> Result<File> {
    let _ = std::fs::remove_file(path);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| DataError::io(path, e))
}

/// The temporary name a file (`P.bin`, `P.idx`, a tokenizer) is written under by this
/// process, `.P.bin.<pid>.tmp` beside it: runs writing the same prefix never share a file.
pub(crate) fn temporary(path: &Path) -> PathBuf {
    of_this_process(path, "tmp")
}

/// `.NAME.<pid>.<ending>` beside `path` (named `NAME`).
fn of_this_process(path: &Path, ending: &str) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let name = name.unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.{ending}", std::process::id()))
}

/// Streams documents into `P.bin` and writes `P.idx` on [`finish`](Self::finish).
///
/// Only `uint16` and `int32` token dtypes can be written (the ones Megatron's preprocessing
/// produces); each added document becomes one sequence. Both files are written under temporary
/// names of this process (`.P.bin.<pid>.tmp`, `.P.idx.<pid>.tmp`) and renamed into place by
/// `finish`: a writer that fails or is dropped removes its temporary file and leaves an existing
/// dataset of the same prefix intact.
pub struct IndexedDatasetWriter {
    bin: BufWriter<File>,
    /// The temporary `.bin` being written.
    bin_tmp: PathBuf,
    bin_path: PathBuf,
    idx_path: PathBuf,
    finished: bool,
    dtype: DType,
    lengths: Vec<i32>,
    bytes: u64,
    buf: Vec<u8>,
}

impl IndexedDatasetWriter {
    /// Starts writing `prefix.bin` (under a temporary name); `prefix.idx` is written by
    /// [`finish`](Self::finish). Parent directories are created if missing.
    pub fn create(prefix: &Path, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::U16 | DType::I32) {
            return Err(DataError::config(
                "dtype",
                format!(
                    "cannot write {} tokens (only uint16 or int32)",
                    dtype.name()
                ),
            ));
        }
        let bin_path = bin_path(prefix);
        if let Some(parent) = bin_path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| DataError::io(parent, e))?;
        }
        let bin_tmp = temporary(&bin_path);
        let file = create_fresh(&bin_tmp)?;
        Ok(IndexedDatasetWriter {
            bin: BufWriter::with_capacity(1 << 20, file),
            bin_tmp,
            bin_path,
            idx_path: idx_path(prefix),
            finished: false,
            dtype,
            lengths: Vec::new(),
            bytes: 0,
            buf: Vec::new(),
        })
    }

    /// The token dtype being written.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Appends one document (one sequence). Token ids must fit the dtype.
    pub fn add_document(&mut self, tokens: &[u32]) -> Result<()> {
        let len = i32::try_from(tokens.len()).map_err(|_| DataError::OutOfRange {
            what: "document length",
            index: tokens.len() as u64,
            len: i32::MAX as u64,
        })?;
        self.buf.clear();
        for &t in tokens {
            match self.dtype {
                DType::U16 => {
                    let v = u16::try_from(t).map_err(|_| self.bad_token(t))?;
                    self.buf.extend_from_slice(&v.to_le_bytes());
                }
                _ => {
                    let v = i32::try_from(t).map_err(|_| self.bad_token(t))?;
                    self.buf.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        self.bin
            .write_all(&self.buf)
            .map_err(|e| DataError::io(&self.bin_tmp, e))?;
        self.bytes += self.buf.len() as u64;
        self.lengths.push(len);
        Ok(())
    }

    fn bad_token(&self, t: u32) -> DataError {
        DataError::BadToken {
            path: self.bin_path.clone(),
            sequence: self.lengths.len(),
            value: t as i64,
        }
    }

    /// Bytes of `.bin` written so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Flushes `P.bin`, writes `P.idx`, and returns the number of `.bin` bytes written.
    pub fn finish(self) -> Result<u64> {
        self.seal()?.commit()
    }

    /// Flushes `P.bin` and writes `P.idx`, both still under their temporary names: several
    /// datasets written together are sealed one by one and committed once all are.
    pub fn seal(mut self) -> Result<SealedDataset> {
        self.bin
            .flush()
            .and_then(|_| self.bin.get_ref().sync_all())
            .map_err(|e| DataError::io(&self.bin_tmp, e))?;
        let doc_indices: Vec<i64> = (0..=self.lengths.len() as i64).collect();
        let index = encode_index(self.dtype, &self.lengths, &doc_indices);
        let idx_tmp = temporary(&self.idx_path);
        let sealed = SealedDataset {
            bin_tmp: self.bin_tmp.clone(),
            idx_tmp,
            bin_path: self.bin_path.clone(),
            idx_path: self.idx_path.clone(),
            bytes: self.bytes,
            committed: false,
        };
        self.finished = true; // the sealed dataset owns the temporary files now
        let mut idx = create_fresh(&sealed.idx_tmp)?;
        idx.write_all(&index)
            .and_then(|_| idx.sync_all())
            .map_err(|e| DataError::io(&sealed.idx_tmp, e))?;
        Ok(sealed)
    }
}

impl Drop for IndexedDatasetWriter {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_file(&self.bin_tmp);
        }
    }
}

/// A written dataset under temporary names; [`commit`](Self::commit) renames it into place,
/// dropping it uncommitted removes it.
pub struct SealedDataset {
    bin_tmp: PathBuf,
    idx_tmp: PathBuf,
    bin_path: PathBuf,
    idx_path: PathBuf,
    bytes: u64,
    committed: bool,
}

impl SealedDataset {
    /// Renames `P.bin` and `P.idx` into place; returns the `.bin` bytes.
    pub fn commit(self) -> Result<u64> {
        commit_all(vec![self])
    }
}

/// Renames every sealed dataset into place, all or none: the files they replace are first moved
/// aside (`.P.bin.<pid>.old`), and if any rename fails, the ones made are undone and the old
/// files put back, so a failure leaves the earlier datasets as they were. Returns the `.bin`
/// bytes written.
pub fn commit_all(mut sealed: Vec<SealedDataset>) -> Result<u64> {
    let moves: Vec<(PathBuf, PathBuf)> = sealed
        .iter()
        .flat_map(|d| {
            [
                (d.bin_tmp.clone(), d.bin_path.clone()),
                (d.idx_tmp.clone(), d.idx_path.clone()),
            ]
        })
        .collect();
    for (_, to) in &moves {
        if to.is_dir() {
            return Err(DataError::io(
                to,
                std::io::Error::new(std::io::ErrorKind::IsADirectory, "is a directory"),
            ));
        }
    }
    // (final name, where its old file went) for every name that held one.
    let mut moved_aside: Vec<(PathBuf, PathBuf)> = Vec::new();
    let mut placed: Vec<&PathBuf> = Vec::new();
    let mut step = || -> Result<()> {
        for (_, to) in &moves {
            if std::fs::symlink_metadata(to).is_ok() {
                let old = of_this_process(to, "old");
                std::fs::rename(to, &old).map_err(|e| DataError::io(to, e))?;
                moved_aside.push((to.clone(), old));
            }
        }
        for (from, to) in &moves {
            std::fs::rename(from, to).map_err(|e| DataError::io(to, e))?;
            placed.push(to);
        }
        Ok(())
    };
    let done = step();
    if let Err(e) = done {
        for to in placed {
            let _ = std::fs::remove_file(to);
        }
        for (to, old) in moved_aside {
            let _ = std::fs::rename(old, to);
        }
        return Err(e);
    }
    for (_, old) in moved_aside {
        let _ = std::fs::remove_file(old);
    }
    let mut bytes = 0;
    for d in &mut sealed {
        d.committed = true;
        bytes += d.bytes;
    }
    Ok(bytes)
}

impl Drop for SealedDataset {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.bin_tmp);
            let _ = std::fs::remove_file(&self.idx_tmp);
        }
    }
}

/// Encodes a complete `.idx` file for the given sequence lengths and document indices;
/// sequence pointers are the running byte offsets of the sequences.
pub fn encode_index(dtype: DType, lengths: &[i32], doc_indices: &[i64]) -> Vec<u8> {
    let n = lengths.len();
    let mut out = Vec::with_capacity(IDX_HEADER_LEN as usize + 12 * n + 8 * doc_indices.len());
    out.extend_from_slice(IDX_MAGIC);
    out.extend_from_slice(&IDX_VERSION.to_le_bytes());
    out.push(dtype.code());
    out.extend_from_slice(&(n as u64).to_le_bytes());
    out.extend_from_slice(&(doc_indices.len() as u64).to_le_bytes());
    for &l in lengths {
        out.extend_from_slice(&l.to_le_bytes());
    }
    let mut pointer = 0i64;
    for &l in lengths {
        out.extend_from_slice(&pointer.to_le_bytes());
        pointer += l as i64 * dtype.size() as i64;
    }
    for &d in doc_indices {
        out.extend_from_slice(&d.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_codes_round_trip() {
        for code in 1..=8u8 {
            assert_eq!(DType::from_code(code).map(|d| d.code()), Some(code));
        }
        assert_eq!(DType::from_code(0), None);
        assert_eq!(DType::from_code(9), None);
    }

    #[test]
    fn vocab_size_selects_dtype() {
        assert_eq!(DType::for_vocab_size(4096), DType::U16);
        assert_eq!(DType::for_vocab_size(65_499), DType::U16);
        assert_eq!(DType::for_vocab_size(65_500), DType::I32);
        assert_eq!(DType::for_vocab_size(128_256), DType::I32);
    }

    #[test]
    fn suffixes_append_not_replace() {
        assert_eq!(bin_path(Path::new("a/b.v1")), PathBuf::from("a/b.v1.bin"));
        assert_eq!(idx_path(Path::new("a/b")), PathBuf::from("a/b.idx"));
    }
}
