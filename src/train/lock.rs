//! One live run per directory: an advisory lock on `<dir>/run.lock` in the run directory and in
//! the checkpoint directory, held for the whole run.
//!
//! The lock is the operating system's (`flock`), so it is released when the holding process ends
//! in any way, SIGKILL included; the file's text (pid, host, start time) only names the holder.
//! A second run on the same directory is refused with that name. A lock file whose text names a
//! holder but whose lock is free was left by a run that died: it is taken over, and the log says
//! so. A run that ends normally empties the file. The lock file must be a regular file (a link
//! planted in its place is refused, never followed), and only a bounded, printable part of its
//! text is ever shown.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use tracing::warn;

use crate::files::{open_regular, sanitized};

/// Name of the lock file inside a locked directory.
pub const LOCK_FILE: &str = "run.lock";

/// A held run-directory lock; dropping it releases the directory.
#[derive(Debug)]
pub struct RunLock {
    file: File,
    path: PathBuf,
}

/// The holder a lock file names, bounded and printable (whatever bytes it holds).
fn holder_of(file: &mut File) -> String {
    let mut bytes = Vec::new();
    let _ = file.take(4096).read_to_end(&mut bytes);
    sanitized(&bytes, 200)
}

/// This host's name, for naming a lock's holder.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown host".into())
}

impl RunLock {
    /// Locks `dir` (creating it) for this process, or fails naming the run that holds it.
    /// `what` says what the directory is in messages (`run.dir`, `checkpoint.dir`).
    pub fn acquire(dir: &Path, what: &str) -> Result<Self> {
        if dir.exists() && !dir.is_dir() {
            bail!(
                "{what} {} is a file, not a directory; choose another {what}",
                dir.display()
            );
        }
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating {what} {}", dir.display()))?;
        let path = dir.join(LOCK_FILE);
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(true).truncate(false);
        let mut file = open_regular(&path, &mut options, "the lock file")?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let holder = holder_of(&mut file);
                bail!(
                    "{what} {} is in use by another run ({}); wait for it to end or choose \
                     another {what}",
                    dir.display(),
                    if holder.is_empty() {
                        format!("lock {}", path.display())
                    } else {
                        holder
                    }
                );
            }
            Err(TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("locking {}", path.display()))
            }
        }
        let holder = holder_of(&mut file);
        if !holder.is_empty() {
            warn!(
                "{what} {}: taking over the lock of a run that ended without releasing it ({holder})",
                dir.display(),
            );
        }
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let me = format!(
            "pid {} on {}, started at unix time {since}\n",
            std::process::id(),
            host_name()
        );
        file.set_len(0)
            .and_then(|_| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(me.as_bytes()))
            .and_then(|_| file.sync_data())
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(Self { file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        // An empty file marks a clean release; the OS lock goes with the file handle.
        let _ = self.file.set_len(0);
    }
}

/// The locks of a run that writes files: its `run.dir` and its checkpoint root (two runs sharing
/// only a checkpoint directory would still prune each other's checkpoints).
pub fn lock_run(run_dir: &Path, checkpoint_root: &Path) -> Result<Vec<RunLock>> {
    let mut locks = vec![RunLock::acquire(run_dir, "run.dir")?];
    let same = match (run_dir.canonicalize(), checkpoint_root.canonicalize()) {
        (Ok(r), Ok(c)) => r == c,
        _ => run_dir == checkpoint_root,
    };
    if !same {
        locks.push(RunLock::acquire(checkpoint_root, "checkpoint.dir")?);
    }
    Ok(locks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_no_run_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("run");
        std::fs::write(&file, "").unwrap();
        let e = format!("{:#}", RunLock::acquire(&file, "run.dir").unwrap_err());
        assert!(e.contains("is a file, not a directory"), "{e}");
    }

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_name() {
        let tmp = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(tmp.path(), "run.dir").unwrap();
        let e = RunLock::acquire(tmp.path(), "run.dir").unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("in use by another run"), "{msg}");
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        drop(first);
        assert_eq!(
            std::fs::read_to_string(tmp.path().join(LOCK_FILE)).unwrap(),
            ""
        );
        RunLock::acquire(tmp.path(), "run.dir").unwrap();
    }

    #[test]
    fn a_dead_holders_lock_is_taken_over() {
        let tmp = tempfile::tempdir().unwrap();
        // What a killed run leaves: its text, but no OS lock.
        std::fs::write(tmp.path().join(LOCK_FILE), "pid 1 on elsewhere\n").unwrap();
        let lock = RunLock::acquire(tmp.path(), "run.dir").unwrap();
        let text = std::fs::read_to_string(lock.path()).unwrap();
        assert!(
            text.starts_with(&format!("pid {} on ", std::process::id())),
            "{text}"
        );
    }

    #[test]
    fn the_checkpoint_directory_is_locked_too() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        let locks = lock_run(&run, &run.join("checkpoints")).unwrap();
        assert_eq!(locks.len(), 2);
        let e = lock_run(&tmp.path().join("other"), &run.join("checkpoints")).unwrap_err();
        assert!(format!("{e:#}").contains("checkpoint.dir"), "{e:#}");
        drop(locks);
        assert_eq!(lock_run(&run, &run).unwrap().len(), 1);
    }
}
