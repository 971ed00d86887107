//! CPU optimizer offload (`optimizer.offload: cpu`), as ZeRO-Offload does it: AdamW's master
//! weights and moments live in host memory, sharded as ZeRO shards them; each step copies the
//! owned gradients to the host one bucket's part at a time, updates that part on the host's
//! cores while the next part is copied, and hands each updated part on as soon as it is done
//! (the trainer publishes it to the device while the host updates the next).
//!
//! The update is the AdamW kernel's own, applied to a part of the state ([`AdamW::apply_part`]):
//! element-wise, so the offloaded run equals the run without offload bit for bit. Clipping keeps
//! its meaning: the global norm is taken on the device before the first part is updated.

use std::ops::Range;
use std::sync::mpsc;

use candle_core::{Device, Result, Tensor};
use parallel::dp::intersect;

use super::{AdamW, FlatLayout, GradBuffer};

/// A part of the owned elements updated at once: the part of bucket `bucket` a rank owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Its bucket.
    pub bucket: usize,
    /// Its flat range.
    pub flat: Range<usize>,
    /// Where it starts among the owned elements.
    pub at: usize,
}

/// The parts of the owned ranges `owned` of `layout`: each owned range cut at the buckets'
/// edges, in owned order.
pub fn parts(layout: &FlatLayout, owned: &[Range<usize>]) -> Vec<Part> {
    let mut out = Vec::new();
    let mut at = 0;
    for r in owned {
        for (bucket, b) in layout.buckets.iter().enumerate() {
            let flat = intersect(&(b.start..b.start + b.len), r);
            if !flat.is_empty() {
                out.push(Part {
                    bucket,
                    at: at + flat.start - r.start,
                    flat,
                });
            }
        }
        at += r.len();
    }
    out
}

/// The host side of an offloaded AdamW: the parts it updates and the threads it updates them on.
pub struct HostUpdate {
    parts: Vec<Part>,
    pool: rayon::ThreadPool,
    threads: usize,
}

impl HostUpdate {
    /// The update of the owned ranges `owned` of `layout` on `threads` host threads, or with 0
    /// on the machine's cores shared by the ranks a launcher started on it (`LOCAL_WORLD_SIZE`;
    /// thread ranks each take every core).
    pub fn new(threads: usize, layout: &FlatLayout, owned: &[Range<usize>]) -> Result<Self> {
        let threads = if threads > 0 {
            threads
        } else {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let here = std::env::var("LOCAL_WORLD_SIZE")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&n| n > 0)
                .unwrap_or(1);
            (cores / here).max(1)
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("offload-{i}"))
            .build()
            .map_err(|e| candle_core::Error::Msg(format!("optimizer offload threads: {e}")))?;
        Ok(Self {
            parts: parts(layout, owned),
            pool,
            threads,
        })
    }

    /// Threads the update runs on.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// One update of `adamw` (its state on the host) at learning rate `lr`, gradients scaled by
    /// `grad_scale`: each part's gradients copied from `grads` to the host on this thread (the
    /// device's), the parts updated in order on the host threads, one part copied ahead of the
    /// update; `ready(part, masters)` is called on this thread with each part's new master
    /// weights `[len]` (host, f32) once it is updated, while the next is.
    pub fn step(
        &self,
        adamw: &mut AdamW,
        grads: &GradBuffer,
        (lr, grad_scale): (f64, f64),
        mut ready: impl FnMut(&Part, &Tensor) -> Result<()>,
    ) -> Result<()> {
        let parts = &self.parts;
        let Some(op) = adamw.begin(lr, grad_scale) else {
            return Ok(());
        };
        let adamw = &*adamw;
        let master = adamw.master()?;
        let pool = &self.pool;
        std::thread::scope(|s| {
            // One part's gradients staged on the host ahead of the update.
            let (to_update, updates) = mpsc::sync_channel::<(usize, Tensor)>(1);
            let (to_hand, updated) = mpsc::channel::<Result<usize>>();
            let at: Vec<usize> = parts.iter().map(|p| p.at).collect();
            let worker = s.spawn(move || {
                for (k, grad) in updates {
                    let r = pool.install(|| adamw.apply_part(&op, at[k], &grad));
                    let failed = r.is_err();
                    if to_hand.send(r.map(|()| k)).is_err() || failed {
                        break;
                    }
                }
            });
            let mut hand = |k: Result<usize>| -> Result<()> {
                let p = &parts[k?];
                ready(p, &master.narrow(0, p.at, p.flat.len())?)
            };
            for (k, p) in parts.iter().enumerate() {
                let g = Tensor::from_vec(grads.to_host(&p.flat)?, p.flat.len(), &Device::Cpu)?;
                if to_update.send((k, g)).is_err() {
                    break; // the worker stopped on an error, handed on below
                }
                while let Ok(done) = updated.try_recv() {
                    hand(done)?;
                }
            }
            drop(to_update);
            for done in updated {
                hand(done)?;
            }
            worker
                .join()
                .map_err(|_| candle_core::Error::Msg("the offloaded update panicked".into()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cut_the_owned_ranges_at_the_buckets_edges() {
        // Buckets [0, 8) and [8, 20) for 4 ranks (padding to multiples of 4).
        let l = FlatLayout::new(&[5, 3, 7, 2], 8, 4);
        let starts: Vec<_> = l.buckets.iter().map(|b| (b.start, b.len)).collect();
        assert_eq!(starts, vec![(0, 8), (8, 12)]);
        let part = |bucket, flat, at| Part { bucket, flat, at };
        // The whole buffer (no sharding): one part per bucket.
        let whole: Vec<Range<usize>> = std::iter::once(0..20).collect();
        assert_eq!(parts(&l, &whole), vec![part(0, 0..8, 0), part(1, 8..20, 8)]);
        // ZeRO shards: one part per owned range, at its place among the owned elements.
        assert_eq!(
            parts(&l, &[6..8, 17..20]),
            vec![part(0, 6..8, 0), part(1, 17..20, 2)]
        );
    }
}
