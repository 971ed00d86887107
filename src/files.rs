//! Files the binary reads whole and files a run writes, made safe against what a careless or
//! hostile neighbour leaves in their place.
//!
//! Reading: a file read whole (a recipe, an HF `config.json` or index, a tokenizer) must be a
//! regular file under a size cap, checked before anything is read; a FIFO is opened without
//! blocking and refused, `/dev/zero` is refused instead of filling memory.
//!
//! Writing: in a shared runs directory another user could replace `recipe.yaml`, `loss.svg`,
//! `metrics.jsonl` or `run.lock` with a symbolic link to a file of the user running the job,
//! which would then be overwritten or truncated. Whole files are written to a fresh temporary
//! file and renamed over the name (a rename replaces a link, never its target); files kept open
//! (the metrics log, the lock) are opened with `O_NOFOLLOW` and must be regular files.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Why a file cannot be read whole.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Opening or reading failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A FIFO, device, directory or socket.
    #[error("not a regular file")]
    NotRegular,
    /// Larger than the cap.
    #[error("larger than {cap} bytes")]
    TooLarge {
        /// The cap, bytes.
        cap: u64,
    },
}

/// The bytes of `path`, a regular file of at most `cap` bytes (a FIFO is refused without
/// waiting for a writer; a file that grows past the cap while read is refused too).
pub fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>, ReadError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(ReadError::NotRegular);
    }
    if meta.len() > cap {
        return Err(ReadError::TooLarge { cap });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(cap + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(ReadError::TooLarge { cap });
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text, errors naming `path`.
pub fn read_text_capped(path: &Path, cap: u64) -> Result<String> {
    let bytes = read_capped(path, cap).with_context(|| format!("reading {}", path.display()))?;
    String::from_utf8(bytes).with_context(|| format!("reading {}: not UTF-8 text", path.display()))
}

/// An output path given by `flag` can be written: not a directory, in a folder that exists
/// (checked before the work, not after it).
pub fn check_output(flag: &str, path: &Path) -> Result<()> {
    if path.is_dir() {
        anyhow::bail!("{flag} {} is a directory", path.display());
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(dir) = parent.filter(|d| !d.is_dir()) {
        anyhow::bail!("{flag} {}: no folder {}", path.display(), dir.display());
    }
    Ok(())
}

/// Writes `bytes` as `path`, replacing whatever is there (a link included) by rename.
pub fn write_replacing(path: &Path, bytes: &[u8]) -> Result<()> {
    replace_with(path, |tmp| {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(tmp)
            .and_then(|mut f| f.write_all(bytes))
            .map_err(anyhow::Error::from)
    })
}

/// Makes `path` by `write`, which creates and fills the fresh temporary name beside it that it
/// is given; that is then renamed over `path`. A link or FIFO planted at `path` is replaced,
/// never written through, and a failed write leaves whatever was there.
pub fn replace_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp); // a leftover of a run with this pid that died
    let done = write(&tmp).and_then(|_| std::fs::rename(&tmp, path).map_err(Into::into));
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done.with_context(|| format!("writing {}", path.display()))
}

/// Refuses an output `output` that is one of `inputs` (the same file by any spelling or link):
/// writing it would replace what the command reads.
pub fn refuse_output_over_input(output: &Path, inputs: &[&Path], flag: &str) -> Result<()> {
    let Ok(out) = std::fs::canonicalize(output) else {
        return Ok(()); // not there yet: no input can be it
    };
    if inputs
        .iter()
        .any(|i| std::fs::canonicalize(i).is_ok_and(|i| i == out))
    {
        bail!(
            "{flag} {} is also an input: writing it would replace what the command reads",
            output.display()
        );
    }
    Ok(())
}

/// Opens `path` with `options` without following a link, and checks it is a regular file. The
/// open never blocks: a FIFO planted in the file's place (whose open would wait for a peer) is
/// refused at once, as a device or a directory is.
pub fn open_regular(path: &Path, options: &mut OpenOptions, what: &str) -> Result<File> {
    let not_regular = || {
        anyhow::anyhow!(
            "{what} {} is not a regular file; remove it or choose another directory",
            path.display()
        )
    };
    let file = match options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => bail!(
            "{what} {} is a symbolic link; a run writes only regular files it owns: remove the \
             link",
            path.display()
        ),
        // A write-only open of a FIFO without a reader, or of a device without its driver.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Err(not_regular()),
        Err(e) => return Err(e).with_context(|| format!("opening {what} {}", path.display())),
    };
    let meta = file
        .metadata()
        .with_context(|| format!("reading {what} {}", path.display()))?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    // A regular file ignores O_NONBLOCK: the handle reads and writes as any other.
    Ok(file)
}

/// At most `max` characters of `bytes` for a message: printable ASCII kept, anything else `?`.
pub fn sanitized(bytes: &[u8], max: usize) -> String {
    let bytes = bytes.trim_ascii();
    let mut s: String = bytes
        .iter()
        .take(max)
        .map(|&b| match b {
            b' '..=b'~' => b as char,
            _ => '?',
        })
        .collect();
    if bytes.len() > max {
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replacing_a_link_leaves_its_target_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("precious.txt");
        std::fs::write(&target, "precious data").unwrap();
        let link = tmp.path().join("recipe.yaml");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        write_replacing(&link, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious data");
        assert_eq!(std::fs::read_to_string(&link).unwrap(), "new");
        assert!(!std::fs::symlink_metadata(&link).unwrap().is_symlink());
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert_eq!(left.len(), 2, "no temporary file is left");
    }

    #[test]
    fn links_and_other_non_regular_files_are_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("t");
        std::fs::write(&target, "x").unwrap();
        let link = tmp.path().join("run.lock");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let mut o = OpenOptions::new();
        o.read(true).write(true).create(true).truncate(false);
        let e = format!(
            "{:#}",
            open_regular(&link, &mut o, "the lock file").unwrap_err()
        );
        assert!(e.contains("is a symbolic link"), "{e}");
        let e = format!(
            "{:#}",
            open_regular(tmp.path(), &mut o, "the lock file").unwrap_err()
        );
        assert!(e.contains("the lock file"), "{e}");
    }

    #[test]
    fn whole_file_reads_refuse_fifos_devices_and_large_files() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(matches!(read_capped(&fifo, 10), Err(ReadError::NotRegular)));
        let zero = Path::new("/dev/zero");
        assert!(matches!(read_capped(zero, 10), Err(ReadError::NotRegular)));
        assert!(matches!(
            read_capped(tmp.path(), 10),
            Err(ReadError::NotRegular)
        ));
        let f = tmp.path().join("f");
        std::fs::write(&f, "12345").unwrap();
        assert_eq!(read_capped(&f, 5).unwrap(), b"12345");
        assert!(matches!(
            read_capped(&f, 4),
            Err(ReadError::TooLarge { cap: 4 })
        ));
    }

    #[test]
    fn messages_get_bounded_printable_text() {
        assert_eq!(sanitized(b"pid 1 on h\n", 100), "pid 1 on h");
        assert_eq!(sanitized(&[0xff, b'a', 0x1b], 100), "?a?");
        assert_eq!(sanitized(&[b'x'; 300], 4), "xxxx…");
    }
}
