//! Writing a checkpoint: every rank writes its pieces into the temporary step directory, then
//! rank 0 writes the manifest, renames the directory into place, updates `latest` and prunes.

use std::fs::{self, File};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Metadata, TensorInfo};
use sha2::{Digest, Sha256};

use crate::error::CkptError;
use crate::format::{
    FileEntry, Kind, Manifest, PieceDtype, PieceMeta, RankRecord, TensorBlock, Values, FORMAT,
    LATEST, MANIFEST, TOKENIZER,
};
use crate::Result;

/// Name of the directory of `step`: `step-00000100`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The directory a save of `step` under `root` is written into before it is renamed into place
/// (`step-N.tmp`, never a candidate for a resume).
pub fn tmp_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("{}.tmp", step_dir_name(step)))
}

/// Writes `bytes` to `path` and flushes them to disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(CkptError::io(path))?;
    f.write_all(bytes).map_err(CkptError::io(path))?;
    f.sync_all().map_err(CkptError::io(path))
}

/// A source's error for a piece whose values are read while the file is written.
pub type SourceError = Box<dyn std::error::Error + Send + Sync>;

/// One rank's share of a checkpoint: its pieces, each with its values or declared to be read
/// when the file is written ([`RankWriter::write_with`]), so that a save never holds the rank's
/// whole state on the host.
pub struct RankWriter {
    dir: PathBuf,
    rank: usize,
    pieces: Vec<(PieceMeta, Option<Values>)>,
}

impl RankWriter {
    /// Starts rank `rank`'s share of the checkpoint of `step` under `root` (the temporary step
    /// directory is created if needed).
    pub fn new(root: &Path, step: u64, rank: usize) -> Result<Self> {
        let dir = tmp_dir(root, step);
        fs::create_dir_all(&dir).map_err(CkptError::io(&dir))?;
        Ok(Self {
            dir,
            rank,
            pieces: Vec::new(),
        })
    }

    fn file_name(&self) -> String {
        format!("rank-{:05}.safetensors", self.rank)
    }

    fn meta(
        &self,
        kind: Kind,
        block: TensorBlock<'_>,
        range: Range<usize>,
        dtype: PieceDtype,
    ) -> PieceMeta {
        PieceMeta {
            name: block.name.to_string(),
            kind,
            global_shape: block.global_shape.to_vec(),
            block: block.spans(),
            range: (range.start, range.end),
            dtype,
            key: format!("{}/{}/{}", kind.as_str(), block.name, range.start),
            file: self.file_name(),
        }
    }

    /// Adds elements `range` (row-major) of the block `block` (of a tensor of `block.name`),
    /// stored in the type of `data` (f32 values or bf16); `data` must hold the range's length.
    pub fn add(
        &mut self,
        kind: Kind,
        block: TensorBlock<'_>,
        range: Range<usize>,
        data: impl Into<Values>,
    ) {
        let data = data.into();
        debug_assert_eq!(data.len(), range.len());
        let meta = self.meta(kind, block, range, data.dtype());
        self.pieces.push((meta, Some(data)));
    }

    /// Declares a piece like [`RankWriter::add`] whose values, of type `dtype`, the `fill` of
    /// [`RankWriter::write_with`] gives when the file is written; returns its index there.
    pub fn declare(
        &mut self,
        kind: Kind,
        block: TensorBlock<'_>,
        range: Range<usize>,
        dtype: PieceDtype,
    ) -> usize {
        let meta = self.meta(kind, block, range, dtype);
        self.pieces.push((meta, None));
        self.pieces.len() - 1
    }

    /// Writes the rank's safetensors file and its sidecar record (every piece must have its
    /// values: see [`RankWriter::write_with`] for declared ones).
    pub fn write(self) -> Result<()> {
        self.write_with(|_, m| Err(format!("{}: declared without a source", m.key).into()))
    }

    /// Writes the rank's safetensors file and its sidecar record, taking each declared piece's
    /// values from `fill(index, meta)` (its index from [`RankWriter::declare`]) as the file
    /// reaches it: the host holds one piece's values at a time (and a 1 MiB write buffer),
    /// hashing the bytes as they go. The file is what `safetensors::serialize` makes of the
    /// pieces, byte for byte: pieces sorted by dtype (f32 first), then by key; the header
    /// padded with spaces to a multiple of 8 bytes.
    pub fn write_with(
        self,
        mut fill: impl FnMut(usize, &PieceMeta) -> std::result::Result<Values, SourceError>,
    ) -> Result<()> {
        let path = self.dir.join(self.file_name());
        let format_error = |message: String| CkptError::Format {
            path: path.clone(),
            message,
        };
        let mut order: Vec<usize> = (0..self.pieces.len()).collect();
        let dtype = |i: usize| safetensors_dtype(self.pieces[i].0.dtype);
        order.sort_by(|&a, &b| {
            let key = |i: usize| &self.pieces[i].0.key;
            dtype(b).cmp(&dtype(a)).then(key(a).cmp(key(b)))
        });
        let mut offset = 0;
        let infos = order
            .iter()
            .map(|&i| {
                let m = &self.pieces[i].0;
                let n = (m.range.1 - m.range.0) * m.dtype.width();
                let info = TensorInfo {
                    dtype: dtype(i),
                    shape: vec![m.range.1 - m.range.0],
                    data_offsets: (offset, offset + n),
                };
                offset += n;
                (m.key.clone(), info)
            })
            .collect();
        let metadata = Metadata::new(None, infos).map_err(|e| format_error(e.to_string()))?;
        let mut header = serde_json::to_string(&metadata)
            .map_err(|e| format_error(e.to_string()))?
            .into_bytes();
        header.resize(header.len().next_multiple_of(8), b' ');
        let file = File::create(&path).map_err(CkptError::io(&path))?;
        let mut out = Hashing {
            inner: std::io::BufWriter::with_capacity(1 << 20, file),
            hash: Sha256::new(),
            bytes: 0,
        };
        let io = CkptError::io(&path);
        let written = (|| -> std::io::Result<()> {
            out.write_all(&(header.len() as u64).to_le_bytes())?;
            out.write_all(&header)
        })();
        written.map_err(io)?;
        for &i in &order {
            let (meta, values) = &self.pieces[i];
            let filled;
            let values = match values {
                Some(v) => v,
                None => {
                    filled = fill(i, meta).map_err(|e| CkptError::Mismatch {
                        dir: self.dir.clone(),
                        message: format!("reading {}: {e}", meta.key),
                    })?;
                    &filled
                }
            };
            let want = meta.range.1 - meta.range.0;
            if values.len() != want || values.dtype() != meta.dtype {
                return Err(CkptError::Mismatch {
                    dir: self.dir.clone(),
                    message: format!(
                        "{}: {} {:?} values for a piece of {want} {:?}",
                        meta.key,
                        values.len(),
                        values.dtype(),
                        meta.dtype
                    ),
                });
            }
            out.write_all(&values.le_bytes())
                .map_err(CkptError::io(&path))?;
        }
        let Hashing { inner, hash, bytes } = out;
        let file = inner
            .into_inner()
            .map_err(|e| CkptError::io(&path)(e.into_error()))?;
        file.sync_all().map_err(CkptError::io(&path))?;
        let record = RankRecord {
            file: FileEntry {
                name: self.file_name(),
                bytes,
                sha256: hex(&hash.finalize()),
            },
            pieces: self.pieces.into_iter().map(|(m, _)| m).collect(),
        };
        // The record is renamed into place: its presence means the rank's share is complete.
        let side = self.dir.join(format!("rank-{:05}.json", self.rank));
        let tmp = self.dir.join(format!("rank-{:05}.json.tmp", self.rank));
        let json = serde_json::to_vec(&record).expect("records serialise");
        write_synced(&tmp, &json)?;
        fs::rename(&tmp, &side).map_err(CkptError::io(&side))
    }
}

/// A writer that hashes and counts what goes through it.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The safetensors type of a piece's values.
pub(crate) fn safetensors_dtype(d: PieceDtype) -> safetensors::Dtype {
    match d {
        PieceDtype::F32 => safetensors::Dtype::F32,
        PieceDtype::Bf16 => safetensors::Dtype::BF16,
    }
}

/// Checks that `pieces` hold every element of every tensor exactly once for each kind, and every
/// tensor the kinds of its optimizer (AdamW's two moments or Muon's momentum): a checkpoint with a
/// hole (a rank that skipped a piece) or a duplicate is refused when it is written, not when a
/// resume needs it.
fn check_complete(pieces: &[PieceMeta], dir: &Path) -> Result<()> {
    use std::collections::BTreeMap;
    let mut count: BTreeMap<(&str, Kind), (usize, usize)> = BTreeMap::new();
    for p in pieces {
        let whole: usize = p.global_shape.iter().product();
        let e = count.entry((p.name.as_str(), p.kind)).or_insert((0, whole));
        e.0 += p.range.1.saturating_sub(p.range.0);
    }
    let problem = |message: String| CkptError::Mismatch {
        dir: dir.to_path_buf(),
        message: format!("incomplete checkpoint: {message}"),
    };
    for ((name, kind), (have, whole)) in &count {
        if have != whole {
            return Err(problem(format!(
                "{} of {name} has {have} of its {whole} elements",
                kind.as_str()
            )));
        }
    }
    for (name, _) in count.keys() {
        let has = |kind: Kind| count.contains_key(&(name, kind));
        let missing = if has(Kind::Momentum) && !has(Kind::ExpAvg) {
            Kind::MUON.into_iter().find(|&k| !has(k))
        } else {
            Kind::ADAMW.into_iter().find(|&k| !has(k))
        };
        if let Some(kind) = missing {
            return Err(problem(format!("no {} of {name}", kind.as_str())));
        }
    }
    Ok(())
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Lower-case hex SHA-256 of everything `r` yields (as a manifest records a file's checksum).
pub fn sha256_hex(r: &mut impl std::io::Read) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    std::io::copy(r, &mut hasher)?;
    Ok(hex(&hasher.finalize()))
}

/// Completes the checkpoint of `step` once all `world_size` ranks have written: collects their
/// records into `manifest` (whose `files`/`pieces`/`tokenizer` are filled here), copies `tokenizer`, writes the
/// manifest last, renames the directory into place, points `latest` at it and keeps the newest
/// `keep` checkpoints. Returns the step directory.
pub fn finalize(
    root: &Path,
    mut manifest: Manifest,
    world_size: usize,
    tokenizer: &Path,
    keep: usize,
) -> Result<PathBuf> {
    let tmp = tmp_dir(root, manifest.step);
    manifest.format = FORMAT.to_string();
    manifest.files.clear();
    manifest.pieces.clear();
    for rank in 0..world_size {
        let side = tmp.join(format!("rank-{rank:05}.json"));
        let text = fs::read(&side).map_err(CkptError::io(&side))?;
        let record: RankRecord = serde_json::from_slice(&text).map_err(|e| CkptError::Format {
            path: side.clone(),
            message: e.to_string(),
        })?;
        manifest.files.push(record.file);
        manifest.pieces.extend(record.pieces);
    }
    check_complete(&manifest.pieces, &tmp)?;
    let tok = tmp.join(TOKENIZER);
    // Read, then written: a failure names the file it happened to (the destination on a full
    // disk, not the source).
    let copied = fs::read(tokenizer).map_err(CkptError::io(tokenizer))?;
    write_synced(&tok, &copied)?;
    manifest.tokenizer = Some(FileEntry {
        name: TOKENIZER.to_string(),
        bytes: copied.len() as u64,
        sha256: hex(&Sha256::digest(&copied)),
    });
    let json = serde_json::to_vec_pretty(&manifest).expect("manifests serialise");
    write_synced(&tmp.join(MANIFEST), &json)?;

    let dir = root.join(step_dir_name(manifest.step));
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(CkptError::io(&dir))?;
    }
    fs::rename(&tmp, &dir).map_err(CkptError::io(&tmp))?;
    let latest_tmp = root.join("latest.tmp");
    write_synced(&latest_tmp, step_dir_name(manifest.step).as_bytes())?;
    fs::rename(&latest_tmp, root.join(LATEST)).map_err(CkptError::io(root.join(LATEST)))?;
    File::open(root)
        .and_then(|d| d.sync_all())
        .map_err(CkptError::io(root))?;
    prune(root, keep, manifest.step)?;
    Ok(dir)
}

/// Keeps the checkpoint of step `current` and the `keep - 1` newest complete ones before it,
/// removing older ones and leftover temporary directories. Checkpoints of later steps (a run
/// restarted from an earlier checkpoint) are never removed.
pub fn prune(root: &Path, keep: usize, current: u64) -> Result<()> {
    let mut steps: Vec<(u64, PathBuf)> = Vec::new();
    for e in fs::read_dir(root).map_err(CkptError::io(root))? {
        let path = e.map_err(CkptError::io(root))?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("")
            .to_string();
        if let Some(n) = name.strip_prefix("step-") {
            if n.ends_with(".tmp") {
                fs::remove_dir_all(&path).map_err(CkptError::io(&path))?;
            } else if let (Ok(s), true) = (n.parse::<u64>(), path.join(MANIFEST).exists()) {
                if s < current {
                    steps.push((s, path));
                }
            }
        }
    }
    steps.sort();
    let drop = steps.len().saturating_sub(keep.saturating_sub(1));
    for (_, path) in steps.into_iter().take(drop) {
        fs::remove_dir_all(&path).map_err(CkptError::io(&path))?;
    }
    Ok(())
}
