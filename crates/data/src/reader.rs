//! Defines [`IndexedDataset`], a memory-mapped, fully validated reader for Megatron
//! indexed datasets (`P.bin` + `P.idx`, layout in [`crate::indexed`]).

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{DataError, Result};
use crate::indexed::{bin_path, idx_path, DType, IDX_HEADER_LEN, IDX_MAGIC, IDX_VERSION};

/// Opens `path` for reading without blocking: a FIFO planted in its place (whose open or read
/// would wait for a writer) is refused at once, as a device, a socket or a directory is. (A
/// regular file ignores `O_NONBLOCK`, so the handle reads as any other.)
pub(crate) fn open_regular(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a FIFO, device, socket or directory)",
        ));
    }
    Ok(file)
}

/// The whole of the regular file `path` (see [`open_regular`]).
pub(crate) fn read_regular(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    open_regular(path)?.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// An opened indexed dataset. Tokens stay in the memory-mapped `.bin`; only the index
/// arrays (lengths, pointers, document indices) are held in memory.
pub struct IndexedDataset {
    prefix: PathBuf,
    bin_path: PathBuf,
    dtype: DType,
    lengths: Vec<u32>,
    pointers: Vec<u64>,
    doc_indices: Vec<u64>,
    bin: Mmap,
}

impl std::fmt::Debug for IndexedDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexedDataset")
            .field("prefix", &self.prefix)
            .field("dtype", &self.dtype)
            .field("sequences", &self.lengths.len())
            .field("documents", &self.num_documents())
            .finish()
    }
}

/// Reads little-endian fields from the `.idx` bytes, reporting truncation by field name.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, field: &'static str, n: u64) -> Result<&'a [u8]> {
        let end = (self.pos as u64).saturating_add(n);
        if end > self.bytes.len() as u64 {
            return Err(DataError::Truncated {
                path: self.path.to_path_buf(),
                field,
                expected: end,
                found: self.bytes.len() as u64,
            });
        }
        let s = &self.bytes[self.pos..end as usize];
        self.pos = end as usize;
        Ok(s)
    }

    fn u64(&mut self, field: &'static str) -> Result<u64> {
        let b = self.take(field, 8)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }

    fn array(&mut self, field: &'static str, count: u64, width: u64) -> Result<&'a [u8]> {
        let n = count
            .checked_mul(width)
            .ok_or_else(|| DataError::Truncated {
                path: self.path.to_path_buf(),
                field,
                expected: u64::MAX,
                found: self.bytes.len() as u64,
            })?;
        self.take(field, n)
    }
}

fn inconsistent(path: &Path, field: &'static str, index: u64, exp: u64, found: i64) -> DataError {
    DataError::Inconsistent {
        path: path.to_path_buf(),
        field,
        index,
        expected: exp.to_string(),
        found: found.to_string(),
    }
}

impl IndexedDataset {
    /// Opens `prefix.idx` and `prefix.bin`, validating the whole index against the format and
    /// the `.bin` length. Fails on empty datasets (no sequences).
    pub fn open(prefix: impl AsRef<Path>) -> Result<Self> {
        let prefix = prefix.as_ref().to_path_buf();
        let idx = idx_path(&prefix);
        let idx_bytes = read_regular(&idx).map_err(|e| DataError::io(&idx, e))?;
        let mut cur = Cursor {
            bytes: &idx_bytes,
            pos: 0,
            path: &idx,
        };

        let magic = cur.take("magic", IDX_MAGIC.len() as u64)?;
        if magic != IDX_MAGIC {
            return Err(DataError::BadMagic {
                path: idx.clone(),
                expected: IDX_MAGIC.to_vec(),
                found: magic.to_vec(),
            });
        }
        let version = cur.u64("version")?;
        if version != IDX_VERSION {
            return Err(DataError::BadVersion {
                path: idx.clone(),
                expected: IDX_VERSION,
                found: version,
            });
        }
        let code = cur.take("dtype", 1)?[0];
        let dtype = DType::from_code(code).ok_or(DataError::UnknownDtype {
            path: idx.clone(),
            code,
        })?;
        if dtype.max_token().is_none() {
            return Err(DataError::UnsupportedDtype {
                path: idx.clone(),
                dtype: dtype.name(),
            });
        }
        let n = cur.u64("sequence_count")?;
        let d = cur.u64("document_count")?;
        debug_assert_eq!(cur.pos as u64, IDX_HEADER_LEN);
        if n == 0 {
            return Err(DataError::EmptyDataset {
                path: idx.clone(),
                what: "sequence count is 0".into(),
            });
        }
        if d < 2 {
            return Err(DataError::Inconsistent {
                path: idx.clone(),
                field: "document_count",
                index: 0,
                expected: "at least 2 (leading 0 + one document end)".into(),
                found: d.to_string(),
            });
        }
        let raw_lengths = cur.array("sequence_lengths", n, 4)?;
        let raw_pointers = cur.array("sequence_pointers", n, 8)?;
        let raw_docs = cur.array("document_indices", d, 8)?;
        let rest = idx_bytes.len() as u64 - cur.pos as u64;
        // Megatron's multimodal variant appends one int8 mode per sequence; tolerate that only.
        if rest != 0 && rest != n {
            return Err(DataError::Inconsistent {
                path: idx.clone(),
                field: "file length",
                index: 0,
                expected: format!("{} bytes", cur.pos),
                found: format!("{} bytes", idx_bytes.len()),
            });
        }

        let item = dtype.size() as u64;
        let mut lengths = Vec::with_capacity(n as usize);
        for (i, c) in raw_lengths.chunks_exact(4).enumerate() {
            let v = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            if v < 0 {
                return Err(inconsistent(
                    &idx,
                    "sequence_lengths",
                    i as u64,
                    0,
                    v as i64,
                ));
            }
            lengths.push(v as u32);
        }
        let mut pointers = Vec::with_capacity(n as usize);
        let mut expected_ptr = 0u64;
        for (i, c) in raw_pointers.chunks_exact(8).enumerate() {
            let v = i64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
            if v < 0 || v as u64 != expected_ptr {
                return Err(inconsistent(
                    &idx,
                    "sequence_pointers",
                    i as u64,
                    expected_ptr,
                    v,
                ));
            }
            pointers.push(v as u64);
            expected_ptr += lengths[i] as u64 * item;
        }
        let mut doc_indices = Vec::with_capacity(d as usize);
        let mut prev = 0i64;
        for (i, c) in raw_docs.chunks_exact(8).enumerate() {
            let v = i64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
            if i == 0 && v != 0 {
                return Err(inconsistent(&idx, "document_indices", 0, 0, v));
            }
            if v < prev || v as u64 > n {
                return Err(DataError::Inconsistent {
                    path: idx.clone(),
                    field: "document_indices",
                    index: i as u64,
                    expected: format!("monotone value in [{prev}, {n}]"),
                    found: v.to_string(),
                });
            }
            prev = v;
            doc_indices.push(v as u64);
        }
        if prev as u64 != n {
            return Err(inconsistent(&idx, "document_indices", d - 1, n, prev));
        }

        let bin_path = bin_path(&prefix);
        let file = open_regular(&bin_path).map_err(|e| DataError::io(&bin_path, e))?;
        let bin_len = file
            .metadata()
            .map_err(|e| DataError::io(&bin_path, e))?
            .len();
        if bin_len < expected_ptr {
            return Err(DataError::BinTruncated {
                path: bin_path,
                expected: expected_ptr,
                found: bin_len,
            });
        }
        if bin_len > expected_ptr {
            tracing::warn!(
                path = %bin_path.display(),
                expected = expected_ptr,
                found = bin_len,
                "data file longer than its index describes; trailing bytes ignored"
            );
        }
        if expected_ptr == 0 {
            return Err(DataError::EmptyDataset {
                path: idx,
                what: "all sequences have length 0".into(),
            });
        }
        // SAFETY: the map is read-only; the file is not expected to be modified while open.
        let bin = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(&bin_path, e))?;
        Ok(IndexedDataset {
            prefix,
            bin_path,
            dtype,
            lengths,
            pointers,
            doc_indices,
            bin,
        })
    }

    /// The prefix the dataset was opened from.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// Token dtype of the `.bin` file.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of sequences.
    pub fn num_sequences(&self) -> usize {
        self.lengths.len()
    }

    /// Number of documents (the document-index array has one more entry).
    pub fn num_documents(&self) -> usize {
        self.doc_indices.len().saturating_sub(1)
    }

    /// Token count of every sequence.
    pub fn sequence_lengths(&self) -> &[u32] {
        &self.lengths
    }

    /// Document indices as stored: document `k` is sequences `[di[k], di[k+1])`.
    pub fn document_indices(&self) -> &[u64] {
        &self.doc_indices
    }

    /// Total tokens in the dataset.
    pub fn num_tokens(&self) -> u64 {
        self.lengths.iter().map(|&l| l as u64).sum()
    }

    /// The first sequence of `seqs` holding a token id `>= vocab_size`, with that id (the
    /// sequences are scanned in parallel; the lowest such sequence is reported). A range found
    /// clean is remembered for the life of the process (by file, size and modification time), so
    /// the ranks of a job running as threads, and the splits opened again, scan it once.
    pub fn find_token_outside(
        &self,
        seqs: std::ops::Range<usize>,
        vocab_size: usize,
    ) -> Result<Option<(usize, u32)>> {
        use rayon::prelude::*;
        use std::collections::HashSet;
        use std::sync::{Mutex, OnceLock};
        type Key = (
            PathBuf,
            u64,
            Option<std::time::SystemTime>,
            usize,
            usize,
            usize,
        );
        static CLEAN: OnceLock<Mutex<HashSet<Key>>> = OnceLock::new();
        let meta = std::fs::metadata(&self.bin_path).ok();
        let key: Key = (
            self.bin_path.clone(),
            meta.as_ref().map_or(0, |m| m.len()),
            meta.and_then(|m| m.modified().ok()),
            seqs.start,
            seqs.end,
            vocab_size,
        );
        let clean = CLEAN.get_or_init(Default::default);
        if clean.lock().is_ok_and(|c| c.contains(&key)) {
            return Ok(None);
        }
        let found = seqs
            .into_par_iter()
            .map(|s| -> Result<Option<(usize, u32)>> {
                let ids = self.get(s, 0, self.lengths[s] as usize)?;
                Ok(ids
                    .into_iter()
                    .find(|&t| t as usize >= vocab_size)
                    .map(|t| (s, t)))
            })
            .find_first(|r| !matches!(r, Ok(None)));
        let found = found.unwrap_or(Ok(None))?;
        if found.is_none() {
            if let Ok(mut c) = clean.lock() {
                c.insert(key);
            }
        }
        Ok(found)
    }

    /// The document holding sequence `seq`.
    pub fn document_of(&self, seq: usize) -> usize {
        self.doc_indices
            .partition_point(|&d| d as usize <= seq)
            .saturating_sub(1)
    }

    /// Tokens `[offset, offset + len)` of sequence `seq` as `u32` ids; reads only those bytes.
    pub fn get(&self, seq: usize, offset: usize, len: usize) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(len);
        self.read_into(seq, offset, len, &mut out)?;
        Ok(out)
    }

    /// Like [`get`](Self::get) but appends to `out`.
    pub fn read_into(
        &self,
        seq: usize,
        offset: usize,
        len: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let seq_len = *self.lengths.get(seq).ok_or(DataError::OutOfRange {
            what: "sequence",
            index: seq as u64,
            len: self.lengths.len() as u64,
        })? as usize;
        let end = offset.saturating_add(len);
        if end > seq_len {
            return Err(DataError::OutOfRange {
                what: "token end in sequence",
                index: end as u64,
                len: seq_len as u64,
            });
        }
        let item = self.dtype.size();
        let start = self.pointers[seq] as usize + offset * item;
        let bin: &[u8] = &self.bin;
        let bytes = &bin[start..start + len * item];
        let bad = |value: i64| DataError::BadToken {
            path: self.bin_path.clone(),
            sequence: seq,
            value,
        };
        let push = |v: i64, out: &mut Vec<u32>| -> Result<()> {
            if v < 0 || v > u32::MAX as i64 {
                return Err(bad(v));
            }
            out.push(v as u32);
            Ok(())
        };
        match self.dtype {
            DType::U16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
            ),
            DType::U8 => out.extend(bytes.iter().map(|&b| b as u32)),
            DType::I8 => {
                for &b in bytes {
                    push(b as i8 as i64, out)?;
                }
            }
            DType::I16 => {
                for c in bytes.chunks_exact(2) {
                    push(i16::from_le_bytes([c[0], c[1]]) as i64, out)?;
                }
            }
            DType::I32 => {
                for c in bytes.chunks_exact(4) {
                    push(i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64, out)?;
                }
            }
            DType::I64 => {
                for c in bytes.chunks_exact(8) {
                    push(i64::from_le_bytes(c.try_into().unwrap_or([0; 8])), out)?;
                }
            }
            DType::F32 | DType::F64 => {
                return Err(DataError::UnsupportedDtype {
                    path: self.bin_path.clone(),
                    dtype: self.dtype.name(),
                })
            }
        }
        Ok(())
    }
}
