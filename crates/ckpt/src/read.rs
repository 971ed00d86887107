//! Reading a checkpoint: manifest and integrity checks, finding the newest complete checkpoint,
//! and assembling any block of any tensor from the pieces of whichever ranks wrote it.

use std::collections::HashMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};

use half::bf16;
use memmap2::Mmap;
use safetensors::SafeTensors;

use crate::error::CkptError;
use crate::format::{
    FileEntry, Kind, Manifest, PieceDtype, PieceMeta, TensorBlock, FORMAT, MANIFEST, TOKENIZER,
};
use crate::write::{safetensors_dtype, sha256_hex};
use crate::Result;

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

/// An opened, verified checkpoint.
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    files: HashMap<String, Mmap>,
    by_tensor: HashMap<(String, Kind), Vec<usize>>,
}

fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    // Only a path that is not there is "missing"; one that cannot be read (permissions) says so.
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(CkptError::io(dir)(e));
        }
        _ => {
            return Err(CkptError::NoCheckpoint {
                dir: dir.to_path_buf(),
            })
        }
    }
    if !path.try_exists().map_err(CkptError::io(&path))? {
        let mismatch = |message: String| CkptError::Mismatch {
            dir: dir.to_path_buf(),
            message,
        };
        // Two directories often given for a step directory, named for what they are.
        if let Some(newest) = saved_steps(dir)?.last() {
            return Err(mismatch(format!(
                "a checkpoint root, not a step directory: name one of its step directories (the \
                 newest is {})",
                dir.join(crate::step_dir_name(*newest)).display()
            )));
        }
        if dir.join("config.json").is_file() {
            return Err(mismatch(
                "a Hugging Face model directory, not a checkpoint: make one of it with \
                 `pretrain import-hf`"
                    .into(),
            ));
        }
        return Err(CkptError::Incomplete {
            dir: dir.to_path_buf(),
            file: MANIFEST,
        });
    }
    let text = read_regular(&path).map_err(CkptError::io(&path))?;
    let m: Manifest = serde_json::from_slice(&text).map_err(|e| CkptError::Format {
        path: path.clone(),
        message: e.to_string(),
    })?;
    if m.format != FORMAT {
        return Err(CkptError::Format {
            path,
            message: format!("format `{}`, expected `{FORMAT}`", m.format),
        });
    }
    if let Some(named) = step_of(dir).filter(|&s| s != m.step) {
        return Err(CkptError::Format {
            path,
            message: format!(
                "the manifest says step {}, the directory's name step {named}",
                m.step
            ),
        });
    }
    Ok(m)
}

/// The first entry making `root` a root of checkpoints (`latest`, a step directory), if any.
pub fn checkpoint_entry(root: &Path) -> Option<String> {
    std::fs::read_dir(root).ok()?.flatten().find_map(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        (name == crate::format::LATEST || step_of(&e.path()).is_some()).then_some(name)
    })
}

/// The step a directory's name (`step-N`) gives, if it has that form.
fn step_of(dir: &Path) -> Option<u64> {
    dir.file_name()?
        .to_str()?
        .strip_prefix("step-")?
        .parse::<u64>()
        .ok()
}

/// The steps of the complete checkpoints under `root` (step directories with a manifest), in
/// order; empty when there are none or no `root`.
pub fn saved_steps(root: &Path) -> Result<Vec<u64>> {
    let entries = match fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(CkptError::io(root)(e)),
    };
    let mut steps = Vec::new();
    for e in entries {
        let path = e.map_err(CkptError::io(root))?.path();
        if let Some(step) = step_of(&path).filter(|_| path.join(MANIFEST).exists()) {
            steps.push(step);
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

/// The newest checkpoint under `root`: the one `latest` names (the last one saved), or without a
/// `latest` file the highest step directory. `Ok(None)` when there is none (or no `root`). A
/// newest checkpoint whose manifest cannot be read is an error naming it, never passed over for
/// an older one: resuming from the older one would later save over it. (A save that died leaves
/// only `step-N.tmp`, which is never a candidate.)
pub fn find_latest(root: &Path) -> Result<Option<PathBuf>> {
    let unusable = |dir: &Path, e: CkptError| CkptError::Mismatch {
        dir: dir.to_path_buf(),
        message: format!(
            "the newest checkpoint cannot be read ({e}); move it aside to resume from an older \
             one, or set checkpoint.resume to a step directory"
        ),
    };
    let latest = root.join(crate::format::LATEST);
    if latest.exists() {
        let name = read_regular(&latest)
            .and_then(|b| {
                String::from_utf8(b).map_err(|_| {
                    let bad = "stream did not contain valid UTF-8";
                    std::io::Error::new(std::io::ErrorKind::InvalidData, bad)
                })
            })
            .map_err(CkptError::io(&latest))?;
        let name = name.trim();
        // The fault is `latest`'s when it names nothing usable as a step directory.
        let bad_latest = |why: String| CkptError::Mismatch {
            dir: root.to_path_buf(),
            message: format!(
                "{} {why}; fix or remove it (without it the highest step directory is used), or \
                 set checkpoint.resume to a step directory",
                latest.display()
            ),
        };
        if name.is_empty() {
            return Err(bad_latest("is empty".into()));
        }
        let dir = root.join(name);
        if !dir.is_dir() {
            return Err(bad_latest(format!(
                "names {name}, which is not a checkpoint directory"
            )));
        }
        return match read_manifest(&dir) {
            Ok(_) => Ok(Some(dir)),
            Err(e) => Err(unusable(&dir, e)),
        };
    }
    let Ok(entries) = fs::read_dir(root) else {
        return Ok(None);
    };
    let newest = entries
        .flatten()
        .map(|e| e.path())
        .filter_map(|p| Some((step_of(&p)?, p)))
        .max_by_key(|(s, _)| *s);
    match newest {
        None => Ok(None),
        Some((_, dir)) => match read_manifest(&dir) {
            Ok(_) => Ok(Some(dir)),
            Err(e) => Err(unusable(&dir, e)),
        },
    }
}

/// The file `f` of the step directory `dir`, opened once its size and SHA-256 are checked.
fn verified(dir: &Path, f: &FileEntry) -> Result<(PathBuf, File)> {
    let path = dir.join(&f.name);
    let mut file = open_regular(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CkptError::MissingFile { path: path.clone() },
        _ => CkptError::io(&path)(e),
    })?;
    let len = file.metadata().map_err(CkptError::io(&path))?.len();
    if len != f.bytes {
        let (expected, found) = (format!("{} bytes", f.bytes), format!("{len} bytes"));
        return Err(CkptError::Corrupt {
            path,
            what: "size",
            expected,
            found,
        });
    }
    let sum = sha256_hex(&mut file).map_err(CkptError::io(&path))?;
    if sum != f.sha256 {
        return Err(CkptError::Corrupt {
            path,
            what: "sha256",
            expected: f.sha256.clone(),
            found: sum,
        });
    }
    Ok((path, file))
}

impl Checkpoint {
    /// Opens the step directory `dir`, checking that the manifest exists and that every shard
    /// file and the tokenizer copy are present with the recorded size and SHA-256.
    pub fn open(dir: &Path) -> Result<Self> {
        let manifest = read_manifest(dir)?;
        let mut files = HashMap::new();
        // Bytes of every stored tensor: (file, key) → length.
        let mut stored: HashMap<(String, String), usize> = HashMap::new();
        if let Some(t) = &manifest.tokenizer {
            verified(dir, t)?;
        }
        for f in &manifest.files {
            let (path, file) = verified(dir, f)?;
            // SAFETY: the file is only read, and checkpoints are not modified once complete.
            let map = unsafe { Mmap::map(&file) }.map_err(CkptError::io(&path))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| CkptError::Format {
                path: path.clone(),
                message: e.to_string(),
            })?;
            for (key, view) in st.tensors() {
                stored.insert((f.name.clone(), key), view.data().len());
            }
            files.insert(f.name.clone(), map);
        }
        let mut by_tensor: HashMap<(String, Kind), Vec<usize>> = HashMap::new();
        let mut covered: HashMap<(String, Kind), usize> = HashMap::new();
        let bad = |message: String| CkptError::Format {
            path: dir.join(MANIFEST),
            message,
        };
        for (i, p) in manifest.pieces.iter().enumerate() {
            // Every piece is data that exists: reading never allocates more than the files hold.
            let len = p.range.1.saturating_sub(p.range.0);
            let bytes = len.checked_mul(p.dtype.width());
            if stored.get(&(p.file.clone(), p.key.clone())) != bytes.as_ref() {
                return Err(bad(format!(
                    "piece {} claims {len} {} elements, which {} does not hold",
                    p.key,
                    p.dtype.as_str(),
                    p.file
                )));
            }
            *covered.entry((p.name.clone(), p.kind)).or_default() += len;
            let inside = p.block.len() == p.global_shape.len()
                && (1..=2).contains(&p.block.len())
                && p.block
                    .iter()
                    .zip(&p.global_shape)
                    .all(|(&(o, l), &n)| o.checked_add(l).is_some_and(|e| e <= n))
                && p.range.0 <= p.range.1
                && p.range.1 <= p.block.iter().map(|b| b.1).product::<usize>();
            if !inside || !manifest.files.iter().any(|f| f.name == p.file) {
                let path = dir.join(MANIFEST);
                return Err(CkptError::Format {
                    path,
                    message: format!("piece {} has an invalid place: {p:?}", p.key),
                });
            }
            by_tensor
                .entry((p.name.clone(), p.kind))
                .or_default()
                .push(i);
        }
        for ((name, kind), &have) in &covered {
            let shape = &manifest.pieces[by_tensor[&(name.clone(), *kind)][0]].global_shape;
            let whole = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            if whole != Some(have) {
                return Err(bad(format!(
                    "the pieces of {} of {name} hold {have} elements, its shape {shape:?} has {}",
                    kind.as_str(),
                    whole.map_or("more than fit in memory".to_string(), |w| w.to_string())
                )));
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            files,
            by_tensor,
        })
    }

    /// The step directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The tokenizer saved with the checkpoint.
    pub fn tokenizer_path(&self) -> PathBuf {
        self.dir.join(TOKENIZER)
    }

    /// Names of all tensors with master weights, sorted, with their whole shapes.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let mut v: Vec<(String, Vec<usize>)> = self
            .by_tensor
            .iter()
            .filter(|((_, k), _)| *k == Kind::Master)
            .map(|((n, _), ix)| (n.clone(), self.manifest.pieces[ix[0]].global_shape.clone()))
            .collect();
        v.sort();
        v
    }

    fn mismatch(&self, message: String) -> CkptError {
        CkptError::Mismatch {
            dir: self.dir.clone(),
            message,
        }
    }

    fn piece_data(&self, p: &PieceMeta) -> Result<Vec<f32>> {
        let path = self.dir.join(&p.file);
        let map = self
            .files
            .get(&p.file)
            .ok_or_else(|| CkptError::MissingFile { path: path.clone() })?;
        let st = SafeTensors::deserialize(map).map_err(|e| CkptError::Format {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let view = st.tensor(&p.key).map_err(|e| CkptError::Format {
            path: path.clone(),
            message: e.to_string(),
        })?;
        if view.dtype() != safetensors_dtype(p.dtype)
            || view.data().len() != p.dtype.width() * (p.range.1 - p.range.0)
        {
            return Err(CkptError::Format {
                path,
                message: format!(
                    "tensor {} has the wrong type or size (the manifest says {} × {})",
                    p.key,
                    p.range.1 - p.range.0,
                    p.dtype.as_str()
                ),
            });
        }
        let data = view.data();
        Ok(match p.dtype {
            PieceDtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            PieceDtype::Bf16 => data
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        })
    }

    /// Whether the checkpoint holds values of kind `kind` for tensor `name`.
    pub fn has(&self, kind: Kind, name: &str) -> bool {
        self.by_tensor.contains_key(&(name.to_string(), kind))
    }

    /// The type the pieces of `kind` are stored in (f32 where there are none); a checkpoint
    /// written by one run stores every piece of a kind in one type.
    pub fn dtype(&self, kind: Kind) -> PieceDtype {
        self.manifest
            .pieces
            .iter()
            .find(|p| p.kind == kind)
            .map_or(PieceDtype::F32, |p| p.dtype)
    }

    /// The row-major values of the whole tensor `name` of kind `kind`; `global_shape` must match
    /// the checkpoint's.
    pub fn read_tensor(&self, name: &str, kind: Kind, global_shape: &[usize]) -> Result<Vec<f32>> {
        let offset = vec![0; global_shape.len()];
        let block = TensorBlock {
            name,
            global_shape,
            offset: &offset,
            shape: global_shape,
        };
        self.read_block(kind, block)
    }

    /// The row-major values of `block` of kind `kind`, assembled from every piece that overlaps
    /// it, as f32 (bf16 pieces widen exactly). `block.global_shape` must match the checkpoint's;
    /// every element of the block must be present exactly once.
    pub fn read_block(&self, kind: Kind, block: TensorBlock<'_>) -> Result<Vec<f32>> {
        let (name, global_shape) = (block.name, block.global_shape);
        let ix = self
            .by_tensor
            .get(&(name.to_string(), kind))
            .ok_or_else(|| self.mismatch(format!("no {} of tensor {name}", kind.as_str())))?;
        let shape = &self.manifest.pieces[ix[0]].global_shape;
        if shape.as_slice() != global_shape {
            return Err(self.mismatch(format!(
                "{name} has shape {shape:?} in the checkpoint, the model needs {global_shape:?}"
            )));
        }
        let rc = |b: &[(usize, usize)]| match b {
            [r, c] => (*r, *c),
            [c] => ((0, 1), *c),
            _ => ((0, 1), (0, 1)),
        };
        let ((br0, brn), (bc0, bcn)) = rc(&block.spans());
        let mut out = vec![0f32; brn * bcn];
        let mut seen = vec![false; brn * bcn];
        for &i in ix {
            let p = &self.manifest.pieces[i];
            if p.global_shape.as_slice() != global_shape {
                return Err(self.mismatch(format!(
                    "{name}: pieces disagree on the shape ({:?} vs {global_shape:?})",
                    p.global_shape
                )));
            }
            let ((pr0, _), (pc0, pcn)) = rc(&p.block);
            let (a, b) = p.range;
            if pcn == 0 || a >= b {
                continue;
            }
            let data = self.piece_data(p)?;
            for row in a / pcn..=(b - 1) / pcn {
                let (cs, ce) = (
                    (a.max(row * pcn)) - row * pcn,
                    (b.min((row + 1) * pcn)) - row * pcn,
                );
                let gr = pr0 + row;
                if gr < br0 || gr >= br0 + brn {
                    continue;
                }
                let (g0, g1) = ((pc0 + cs).max(bc0), (pc0 + ce).min(bc0 + bcn));
                if g0 >= g1 {
                    continue;
                }
                let src = row * pcn + (g0 - pc0) - a;
                let dst = (gr - br0) * bcn + (g0 - bc0);
                if seen[dst..dst + (g1 - g0)].iter().any(|&x| x) {
                    return Err(
                        self.mismatch(format!("{} of {name}: overlapping pieces", kind.as_str()))
                    );
                }
                seen[dst..dst + (g1 - g0)].fill(true);
                out[dst..dst + (g1 - g0)].copy_from_slice(&data[src..src + (g1 - g0)]);
            }
        }
        let filled = seen.iter().filter(|&&x| x).count();
        if filled != out.len() {
            return Err(self.mismatch(format!(
                "{} of {name}: the pieces cover {filled} of the {} elements requested",
                kind.as_str(),
                out.len()
            )));
        }
        Ok(out)
    }
}
