//! The flight recorder's ring: a header and up to [`SLOTS`] slots of [`SLOT`] bytes, each one JSON
//! object padded with spaces and ended by a newline (a record file reads as text), in memory or
//! in a memory-mapped file. A slot is rewritten when its operation ends; a reader that catches a
//! slot half-written skips it.

use std::path::Path;

use memmap2::MmapMut;
use serde::{Deserialize, Serialize};

/// Operations a ring keeps at most.
pub const SLOTS: usize = 1024;
/// Bytes per slot.
const SLOT: usize = 512;

/// One recorded operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpRecord {
    /// The rank's operation number (all groups), from 1.
    pub n: u64,
    /// Its number among the rank's operations on `key`, from 1.
    pub seq: u64,
    /// `all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`, `barrier`, `all_to_all`,
    /// `send`, `recv`.
    pub op: String,
    /// The group (see `group_key`), or `send:PEER` / `recv:PEER`.
    pub key: String,
    /// Bytes this rank contributed (received, for `recv`).
    pub bytes: usize,
    /// The training step it belongs to.
    pub step: u64,
    /// When it was handed to the rank's communication thread, if it ran there (milliseconds
    /// since the Unix epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_ms: Option<f64>,
    /// Start, milliseconds since the Unix epoch.
    pub start_ms: f64,
    /// End, if it ended.
    pub end_ms: Option<f64>,
    /// Whether it succeeded, once ended.
    pub ok: Option<bool>,
    /// How it failed: `timeout`, `peer` (another rank failed), `invalid`, `error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

/// A rank's record as read back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankRecord {
    /// The rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// Its process.
    pub pid: u32,
    /// Its last operations, oldest first.
    #[serde(default)]
    pub ops: Vec<OpRecord>,
}

enum Store {
    Memory(Vec<u8>),
    /// The mapping of a file this process holds locked (`flock`, through `_lock`) for as long
    /// as it records.
    File {
        map: MmapMut,
        _lock: std::fs::File,
    },
}

/// The ring of one rank.
pub(super) struct Ring {
    store: Store,
    /// Operations it keeps.
    slots: usize,
    /// Operations pushed so far.
    pushed: u64,
}

impl Ring {
    fn bytes(&mut self) -> &mut [u8] {
        match &mut self.store {
            Store::Memory(v) => v,
            Store::File { map, .. } => map,
        }
    }

    fn with(store: Store, slots: usize, rank: usize, world: usize) -> Self {
        let mut ring = Self {
            store,
            slots,
            pushed: 0,
        };
        let header = RankRecord {
            rank,
            world,
            pid: std::process::id(),
            ops: Vec::new(),
        };
        let text = serde_json::to_string(&header).unwrap_or_default();
        ring.put(0, &text);
        ring
    }

    /// A ring of `slots` operations (1 to [`SLOTS`]) in memory.
    pub(super) fn memory(slots: usize, rank: usize, world: usize) -> Self {
        let slots = slots.clamp(1, SLOTS);
        let store = Store::Memory(vec![b' '; (slots + 1) * SLOT]);
        Self::with(store, slots, rank, world)
    }

    /// A ring of `slots` operations (1 to [`SLOTS`]) in the file `path` (created, or emptied
    /// when an earlier run left it; a link, FIFO or other non-regular file there is refused). The file stays locked (`flock`) while the ring lives: a
    /// file locked by a live run is refused, not overwritten.
    pub(super) fn file(
        path: &Path,
        slots: usize,
        rank: usize,
        world: usize,
    ) -> std::io::Result<Self> {
        use std::io::{Error, ErrorKind};
        use std::os::unix::fs::OpenOptionsExt;
        let slots = slots.clamp(1, SLOTS);
        // Never through a link another user planted, never blocking on a FIFO; named in errors.
        let named = |e: Error| Error::new(e.kind(), format!("{}: {e}", path.display()));
        let f = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "{} is a symbolic link; a run writes only regular files it owns: remove \
                         the link",
                        path.display()
                    ),
                ))
            }
            Err(e) => return Err(named(e)),
        };
        if !f.metadata().map_err(named)?.is_file() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "{} is not a regular file; remove it or choose another directory",
                    path.display()
                ),
            ));
        }
        match f.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ResourceBusy,
                    format!(
                        "{} is being recorded by another live run (same run.dir)",
                        path.display()
                    ),
                ))
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(named(e)),
        }
        f.set_len(0).map_err(named)?;
        f.set_len(((slots + 1) * SLOT) as u64).map_err(named)?;
        // SAFETY: the file is this rank's own (locked above); others only read it.
        let mut map = unsafe { MmapMut::map_mut(&f) }.map_err(named)?;
        map.fill(b' ');
        let store = Store::File { map, _lock: f };
        Ok(Self::with(store, slots, rank, world))
    }

    /// Writes `text` (cut to fit) into slot `slot`, padded, newline-terminated.
    fn put(&mut self, slot: usize, text: &str) {
        let dst = &mut self.bytes()[slot * SLOT..(slot + 1) * SLOT];
        let n = text.len().min(SLOT - 1);
        dst[..n].copy_from_slice(&text.as_bytes()[..n]);
        dst[n..SLOT - 1].fill(b' ');
        dst[SLOT - 1] = b'\n';
    }

    /// Stores `r` in the next slot (overwriting the oldest), numbering it; returns the slot.
    pub(super) fn push(&mut self, r: &mut OpRecord) -> usize {
        self.pushed += 1;
        r.n = self.pushed;
        let slot = 1 + ((self.pushed - 1) as usize % self.slots);
        self.write(slot, r);
        slot
    }

    /// Rewrites slot `slot` with `r`.
    pub(super) fn write(&mut self, slot: usize, r: &OpRecord) {
        let text = serde_json::to_string(r).unwrap_or_default();
        self.put(slot, &text);
    }

    /// The record as it stands.
    pub(super) fn read(&mut self) -> RankRecord {
        parse(self.bytes()).unwrap_or(RankRecord {
            rank: 0,
            world: 0,
            pid: 0,
            ops: Vec::new(),
        })
    }
}

/// The bytes of the record file at `path`, or `None` when it is missing, unreadable, a link, a
/// FIFO or other non-regular file (refused without blocking), or larger than a full ring.
pub(super) fn read_file(path: &Path) -> Option<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let cap = ((SLOTS + 1) * SLOT) as u64; // the header and every slot
    let meta = f.metadata().ok()?;
    if !meta.is_file() || meta.len() > cap {
        return None;
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.take(cap).read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

/// A record from a ring's bytes (a file's contents); `None` without a readable header.
pub fn parse(bytes: &[u8]) -> Option<RankRecord> {
    let mut lines = bytes.chunks(SLOT);
    let mut record: RankRecord = serde_json::from_slice(lines.next()?.trim_ascii()).ok()?;
    record.ops = lines
        .filter_map(|l| serde_json::from_slice::<OpRecord>(l.trim_ascii()).ok())
        .collect();
    record.ops.sort_by_key(|o| o.n);
    Some(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u64) -> OpRecord {
        OpRecord {
            n: 0,
            seq,
            op: "all_reduce".into(),
            key: "[0,1]".into(),
            bytes: 8,
            step: 1,
            queued_ms: None,
            start_ms: seq as f64,
            end_ms: None,
            ok: None,
            failure: None,
        }
    }

    /// The ring keeps the newest operations in order, a file holds what memory holds, and a
    /// slot caught half-written is skipped.
    #[test]
    fn the_ring_keeps_the_newest_operations_readable_from_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rank-00001.flight");
        let mut file = Ring::file(&path, SLOTS, 1, 4).unwrap();
        let mut mem = Ring::memory(64, 1, 4);
        for seq in 1..=(SLOTS as u64 + 6) {
            let mut r = record(seq);
            let slot = file.push(&mut r);
            r.end_ms = Some(seq as f64 + 0.5);
            r.ok = Some(true);
            file.write(slot, &r);
            mem.push(&mut record(seq));
        }
        let got = parse(&read_file(&path).unwrap()).unwrap();
        assert_eq!((got.rank, got.world, got.ops.len()), (1, 4, SLOTS));
        assert_eq!(got.ops.first().unwrap().seq, 7);
        assert_eq!(got.ops.last().unwrap().n, SLOTS as u64 + 6);
        assert!(got.ops.iter().all(|o| o.ok == Some(true)));
        assert_eq!(mem.read().ops.len(), 64);
        // The longest record (a listed group of 24 five-digit ranks, every field set) fits.
        let key = format!("{:?}", (10000..10024).collect::<Vec<usize>>()).replace(' ', "");
        let long = OpRecord {
            n: u64::MAX,
            seq: u64::MAX,
            op: "reduce_scatter".into(),
            key,
            bytes: usize::MAX,
            step: u64::MAX,
            queued_ms: Some(1.0e12 / 3.0),
            start_ms: 1.0e12 / 7.0,
            end_ms: Some(1.0e12 / 9.0),
            ok: Some(false),
            failure: Some("timeout".into()),
        };
        assert!(serde_json::to_string(&long).unwrap().len() < SLOT);
        // A torn slot (half of a record) is left out.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[SLOT + 10..2 * SLOT - 1].fill(b' ');
        assert_eq!(parse(&bytes).unwrap().ops.len(), SLOTS - 1);
    }

    /// A live ring's file is refused to a second recorder (another run on the same run.dir)
    /// and left as it was; once the ring is gone, the file is taken and emptied.
    #[test]
    fn a_live_rings_file_is_not_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rank-00000.flight");
        let mut live = Ring::file(&path, 8, 0, 2).unwrap();
        live.push(&mut record(1));
        let before = std::fs::read(&path).unwrap();
        let e = Ring::file(&path, 8, 0, 2).err().unwrap();
        assert_eq!(e.kind(), std::io::ErrorKind::ResourceBusy);
        assert!(e.to_string().contains("another live run"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), before);
        drop(live);
        let _next = Ring::file(&path, 8, 0, 2).unwrap();
        assert!(parse(&std::fs::read(&path).unwrap())
            .unwrap()
            .ops
            .is_empty());
    }

    /// A diagnosis reads only regular record files of at most a full ring: a FIFO planted in
    /// place of one is passed over at once, not waited on, and so are a link and an
    /// oversized file.
    #[test]
    fn record_files_that_are_not_a_rings_are_passed_over_without_blocking() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let ring = dir.path().join("rank-00000.flight");
        let mut live = Ring::file(&ring, 4, 0, 1).unwrap();
        live.push(&mut record(1));
        assert_eq!(parse(&read_file(&ring).unwrap()).unwrap().ops.len(), 1);
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(read_file(&fifo).is_none());
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&ring, &link).unwrap();
        assert!(read_file(&link).is_none());
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b' '; (SLOTS + 1) * SLOT + 1]).unwrap();
        assert!(read_file(&big).is_none());
        assert!(read_file(&dir.path().join("missing")).is_none());
    }
}
