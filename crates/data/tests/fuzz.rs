//! Property-based tests of the dataset reader against hostile `.idx` files: any byte of a valid
//! index overwritten, the file cut short or extended, header counts set to huge values. Opening
//! must return an error or a dataset whose reads stay in bounds — never panic, never allocate
//! more than a bound proportional to the input's size, and finish at once.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::time::{Duration, Instant};

use data::indexed::{idx_path, DType, IndexedDatasetWriter};
use data::IndexedDataset;
use proptest::prelude::*;

/// The system allocator, recording the largest single request of the current thread.
struct Tracking;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator unchanged; the bookkeeping allocates nothing.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LARGEST.try_with(|m| m.set(m.get().max(layout.size())));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = LARGEST.try_with(|m| m.set(m.get().max(new_size)));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Tracking = Tracking;

fn valid_dataset(dir: &Path) -> std::path::PathBuf {
    let prefix = dir.join("ds");
    let mut w = IndexedDatasetWriter::create(&prefix, DType::U16).unwrap();
    for d in 0..12u32 {
        w.add_document(&vec![d + 1; 3 + d as usize % 5]).unwrap();
    }
    w.finish().unwrap();
    prefix
}

/// Opens `prefix` after writing `idx` as its index; checks the properties.
fn open_hostile(prefix: &Path, idx: &[u8]) {
    std::fs::write(idx_path(prefix), idx).unwrap();
    let bin_len = std::fs::metadata(data::indexed::bin_path(prefix))
        .unwrap()
        .len() as usize;
    LARGEST.with(|m| m.set(0));
    let start = Instant::now();
    let opened = IndexedDataset::open(prefix);
    let largest = LARGEST.with(|m| m.get());
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    // The index is read whole; nothing else may be larger than a few times the inputs.
    let bound = 4 * (idx.len() + bin_len) + 4096;
    assert!(
        largest <= bound,
        "allocated {largest} bytes for an input of {} + {bin_len}",
        idx.len()
    );
    if let Ok(ds) = opened {
        for s in 0..ds.num_sequences() {
            let len = ds.sequence_lengths()[s] as usize;
            let _ = ds.get(s, 0, len);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn hostile_indexes_are_errors_not_panics(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in prop::option::of(any::<prop::sample::Index>()),
        extra in prop::collection::vec(any::<u8>(), 0..16),
        huge in prop::option::of((0usize..2, any::<u64>())),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let prefix = valid_dataset(dir.path());
        let mut idx = std::fs::read(idx_path(&prefix)).unwrap();
        for (at, byte) in &edits {
            let i = at.index(idx.len());
            idx[i] = *byte;
        }
        if let Some((field, value)) = huge {
            // sequence_count at 18, document_count at 26
            let at = 18 + 8 * field;
            idx[at..at + 8].copy_from_slice(&value.to_le_bytes());
        }
        if let Some(c) = cut {
            idx.truncate(c.index(idx.len() + 1));
        }
        idx.extend_from_slice(&extra);
        open_hostile(&prefix, &idx);
    }
}
