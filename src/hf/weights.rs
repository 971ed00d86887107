//! The tensors of a Hugging Face model directory, found as transformers finds them:
//! `model.safetensors` when it exists, else `model.safetensors.index.json` and the shards its
//! `weight_map` names. Every tensor must be where the index says and nowhere else.

use std::collections::BTreeMap;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use half::bf16;
use safetensors::SafeTensors;

/// Single-file weights.
pub const SINGLE: &str = "model.safetensors";
/// Index of sharded weights.
pub const INDEX: &str = "model.safetensors.index.json";

/// Memory-mapped weight files and where each tensor lives.
pub struct HfWeights {
    dir: PathBuf,
    maps: BTreeMap<String, memmap2::Mmap>,
    location: BTreeMap<String, String>,
}

fn map(path: &Path) -> Result<memmap2::Mmap> {
    // Links are followed (a Hugging Face cache links its snapshots to blobs); a FIFO is refused
    // below instead of blocking the open until a writer comes.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let meta = file
        .metadata()
        .with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_file() {
        anyhow::bail!("{}: not a regular file", path.display());
    }
    // SAFETY: read-only map of a file nobody modifies while we read it.
    unsafe { memmap2::Mmap::map(&file) }.with_context(|| path.display().to_string())
}

fn names(path: &Path, map: &memmap2::Mmap) -> Result<Vec<String>> {
    let st = SafeTensors::deserialize(map)
        .with_context(|| format!("{}: not a safetensors file", path.display()))?;
    Ok(st.names().into_iter().map(String::from).collect())
}

impl HfWeights {
    /// Opens the weight files of `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let (single, index) = (dir.join(SINGLE), dir.join(INDEX));
        let (mut maps, mut location) = (BTreeMap::new(), BTreeMap::new());
        if single.exists() {
            let m = map(&single)?;
            for n in names(&single, &m)? {
                location.insert(n, SINGLE.to_string());
            }
            maps.insert(SINGLE.to_string(), m);
        } else if index.exists() {
            // An index lists a name and a file per tensor: kilobytes to a few megabytes.
            let bytes = crate::files::read_capped(&index, 256 << 20)
                .with_context(|| format!("reading {}", index.display()))?;
            let v: serde_json::Value = serde_json::from_slice(&bytes)
                .with_context(|| format!("{}: not JSON", index.display()))?;
            let weight_map = v["weight_map"]
                .as_object()
                .with_context(|| format!("{}: no weight_map", index.display()))?;
            let mut wanted: BTreeMap<&str, &str> = BTreeMap::new();
            for (name, file) in weight_map {
                let file = file
                    .as_str()
                    .filter(|f| is_plain_file_name(f))
                    .with_context(|| {
                        format!(
                            "{}: {name} maps to {file}, not a file name",
                            index.display()
                        )
                    })?;
                wanted.insert(name, file);
            }
            let mut files: Vec<&str> = wanted.values().copied().collect();
            files.sort();
            files.dedup();
            for f in files {
                let path = dir.join(f);
                let m = map(&path)?;
                for n in names(&path, &m)? {
                    match wanted.get(n.as_str()) {
                        None => bail!(
                            "{}: tensor {n} is not in {}'s weight_map",
                            path.display(),
                            index.display()
                        ),
                        Some(w) if *w != f => bail!(
                            "tensor {n} is in {} but {} places it in {w}",
                            path.display(),
                            index.display()
                        ),
                        Some(_) => {}
                    }
                    location.insert(n, f.to_string());
                }
                maps.insert(f.to_string(), m);
            }
            if let Some((n, f)) = wanted.iter().find(|(n, _)| !location.contains_key(**n)) {
                bail!(
                    "{}: tensor {n} is missing from {f}, where the index places it",
                    dir.display()
                );
            }
        } else {
            bail!("{}: neither {SINGLE} nor {INDEX} found", dir.display());
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            maps,
            location,
        })
    }

    /// Tensor names present.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.location.keys()
    }

    /// Whether tensor `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// Tensor `name` as f32 values, checked against `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let file = self
            .location
            .get(name)
            .with_context(|| format!("{}: no tensor {name}", self.dir.display()))?;
        let path = self.dir.join(file);
        let st = SafeTensors::deserialize(&self.maps[file])?;
        let t = st.tensor(name)?;
        if t.shape() != shape {
            bail!(
                "{}: {name} has shape {:?}, the model needs {shape:?}",
                path.display(),
                t.shape()
            );
        }
        let b = t.data();
        Ok(match t.dtype() {
            safetensors::Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            safetensors::Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            safetensors::Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            d => bail!("{}: {name} has unsupported dtype {d:?}", path.display()),
        })
    }
}

/// A file name without directories (an index must not point outside the model directory).
fn is_plain_file_name(f: &str) -> bool {
    !f.is_empty() && f != "." && f != ".." && !f.contains(['/', '\\'])
}
