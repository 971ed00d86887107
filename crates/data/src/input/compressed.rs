//! Defines the reader of compressed inputs ([`open`]): gzip through `flate2` (every member of
//! a multi-member file, as `pigz` and `bgzip` write them) and zstandard through `zstd` (every
//! frame). The reader refuses to expand a file more than [`MAX_EXPANSION`] times (a
//! decompression bomb), and its errors say near which compressed byte the stream broke.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Compression;
use crate::error::{DataError, Result};

/// Largest ratio of decompressed to compressed bytes accepted. Text compresses 3-10 times and
/// repetitive JSON some tens of times; a file that expands further is refused (decompress it
/// yourself and pass the plain file if it is meant).
pub const MAX_EXPANSION: u64 = 200;

/// The ratio is judged against at least this many compressed bytes, so the start of a stream
/// (headers, a first block of repeats) does not trip it.
const EXPANSION_FLOOR: u64 = 1 << 20;

/// Counts the compressed bytes the decoder has taken.
struct Counting {
    file: File,
    taken: Arc<AtomicU64>,
}

impl Read for Counting {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read(buf)?;
        self.taken.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// The decoder's output: counts it against the compressed bytes taken and puts the position
/// into its errors.
struct Guarded {
    decoder: Box<dyn Read + Send>,
    taken: Arc<AtomicU64>,
    out: u64,
    path: PathBuf,
    codec: &'static str,
}

impl Read for Guarded {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // Read after the decoder's call: the bytes it took for this output (or this error).
        let result = self.decoder.read(buf);
        let taken = self.taken.load(Ordering::Relaxed);
        match result {
            Ok(n) => {
                self.out += n as u64;
                if self.out > MAX_EXPANSION * taken.max(EXPANSION_FLOOR) {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "{} bytes of {} input decompress to more than {} bytes, over {}x \
                             (a decompression bomb?); decompress {} yourself and pass the \
                             plain file if this is meant",
                            taken,
                            self.codec,
                            self.out,
                            MAX_EXPANSION,
                            self.path.display()
                        ),
                    ));
                }
                Ok(n)
            }
            Err(e) => Err(io::Error::new(
                e.kind(),
                format!(
                    "{} stream damaged or truncated near compressed byte {taken}: {e}",
                    self.codec
                ),
            )),
        }
    }
}

/// The decompressed bytes of `file` (named `path`), or the file itself when not compressed.
pub(super) fn open(
    file: File,
    path: &Path,
    compression: Compression,
) -> Result<Box<dyn Read + Send>> {
    let taken = Arc::new(AtomicU64::new(0));
    let counting = BufReader::with_capacity(
        64 << 10,
        Counting {
            file,
            taken: taken.clone(),
        },
    );
    let (decoder, codec): (Box<dyn Read + Send>, _) = match compression {
        Compression::None => return Ok(Box::new(counting)),
        Compression::Gzip => (
            Box::new(flate2::bufread::MultiGzDecoder::new(counting)),
            "gzip",
        ),
        Compression::Zstd => {
            let d = zstd::stream::read::Decoder::with_buffer(counting)
                .map_err(|e| DataError::io(path, e))?;
            (Box::new(d), "zstd")
        }
    };
    Ok(Box::new(Guarded {
        decoder,
        taken,
        out: 0,
        path: path.to_path_buf(),
        codec,
    }))
}
