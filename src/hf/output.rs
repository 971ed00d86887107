//! Where `export-hf` writes: every file goes first into a staging folder inside the output
//! directory ([`STAGING`]); only once the parity gate has passed does an earlier export there give
//! way (with `--overwrite`) and the new files move into place, each by a rename. A failed export,
//! whatever the cause (a non-finite weight, the gate, a full disk), leaves the directory as it was.
//! One export at a time writes a directory: it holds an exclusive lock (`flock`) on the directory
//! itself throughout, and a second export into the same directory is refused.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::weights;

/// The staging folder, inside the output directory (so that each move is a rename).
pub const STAGING: &str = ".export-hf.partial";

/// Files an export writes (weights match [`is_weight_file`]).
const EXPORT_FILES: [&str; 5] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    weights::INDEX,
];

fn is_weight_file(name: &str) -> bool {
    name == weights::SINGLE || (name.starts_with("model-") && name.ends_with(".safetensors"))
}

/// An output directory being written: the final directory and its staging folder.
pub struct Output {
    dir: PathBuf,
    staging: PathBuf,
    /// The earlier export's files, replaced when the new one is committed.
    earlier: Vec<String>,
    /// Whether `dir` was made for this export (and is removed again if it fails).
    created: bool,
    /// The lock on the directory, held until the export ends.
    _lock: std::fs::File,
}

impl Output {
    /// Checks `dir` (created if missing) and opens an empty staging folder in it. A non-empty
    /// directory is refused unless `overwrite`; a checkpoint's directory always is (its
    /// tokenizer copy is part of the checkpoint).
    pub fn prepare(dir: &Path, overwrite: bool) -> Result<Self> {
        let created = !dir.exists();
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        if dir.join(ckpt::MANIFEST).exists() {
            bail!(
                "{} is a checkpoint (it holds {}); export to a directory of its own",
                dir.display(),
                ckpt::MANIFEST
            );
        }
        let lock = lock(dir)?;
        let mut entries: Vec<String> = std::fs::read_dir(dir)
            .with_context(|| format!("listing {}", dir.display()))?
            .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
            .collect::<std::io::Result<_>>()
            .with_context(|| format!("listing {}", dir.display()))?;
        entries.retain(|e| e != STAGING);
        entries.sort();
        if !entries.is_empty() && !overwrite {
            bail!(
                "{} is not empty ({} entries: {}); pass --overwrite to replace an earlier export",
                dir.display(),
                entries.len(),
                entries
                    .iter()
                    .take(4)
                    .cloned()
                    .chain((entries.len() > 4).then(|| "…".to_string()))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let staging = dir.join(STAGING);
        // A folder left by an export that was killed is ours to clear.
        if staging.exists() {
            std::fs::remove_dir_all(&staging)
                .with_context(|| format!("removing the stale {}", staging.display()))?;
        }
        std::fs::create_dir(&staging).with_context(|| format!("creating {}", staging.display()))?;
        entries.retain(|e| EXPORT_FILES.contains(&e.as_str()) || is_weight_file(e));
        Ok(Self {
            dir: dir.to_path_buf(),
            staging,
            earlier: entries,
            created,
            _lock: lock,
        })
    }

    /// The folder the files are written to.
    pub fn staging(&self) -> &Path {
        &self.staging
    }

    /// Replaces the earlier export's files with the staged ones.
    pub fn commit(self) -> Result<()> {
        for e in &self.earlier {
            let p = self.dir.join(e);
            std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
        }
        let staged = std::fs::read_dir(&self.staging)
            .with_context(|| format!("listing {}", self.staging.display()))?;
        for f in staged {
            let name = f?.file_name();
            let to = self.dir.join(&name);
            std::fs::rename(self.staging.join(&name), &to)
                .with_context(|| format!("moving the export to {}", to.display()))?;
        }
        std::fs::remove_dir(&self.staging)
            .with_context(|| format!("removing {}", self.staging.display()))
    }

    /// Removes the staging folder after a failure (and the directory, if this export made it);
    /// the directory keeps what it held before.
    pub fn abandon(self) {
        if let Err(e) = std::fs::remove_dir_all(&self.staging) {
            tracing::warn!(
                "cleaning up {} after a failed export: {e}",
                self.staging.display()
            );
        }
        if self.created {
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

/// Takes the export lock of `dir` (an exclusive `flock` on the directory), refusing when another
/// export holds it.
fn lock(dir: &Path) -> Result<std::fs::File> {
    let file = std::fs::File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "{} is being written by another export-hf; wait for it to end, or export to another \
             directory",
            dir.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking {}", dir.display()))
        }
    }
}
