//! One rank's step counters: the single sink the parallel machinery reports measurements to.
//!
//! The parts that measure something during a step (the context-parallel ring, the sharded
//! gradient buffer's staging, the data-parallel reductions in flight) each hold the rank's one
//! [`StepStats`], given to them when they are built, and add to it as they run. The trainer
//! drains it once per step with [`StepStats::take`]; nothing is read back through the model or
//! through a component's own counters.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::cp::{RingStats, RingTotals};

/// The counters of one rank, shared (`Arc`) by everything that reports to them.
#[derive(Debug, Default)]
pub struct StepStats {
    /// The context-parallel ring's communication.
    pub ring: RingStats,
    /// The most bytes of full-size gradients staged at once by a sharded gradient buffer.
    grads_staged: AtomicUsize,
    /// The most staging bytes held at once by data-parallel reductions queued or running.
    reductions_staged: AtomicUsize,
}

/// What [`StepStats::take`] returns: the counters since the last take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCounts {
    /// The ring's totals.
    pub ring: RingTotals,
    /// Peak bytes of full-size gradients staged by the gradient buffer.
    pub grads_staged_peak: usize,
    /// Peak staging bytes held by the reductions in flight.
    pub reductions_staged_peak: usize,
}

impl StepStats {
    /// Notes that the gradient buffer holds `bytes` of staged gradients now.
    pub fn grads_staged(&self, bytes: usize) {
        self.grads_staged.fetch_max(bytes, Ordering::Relaxed);
    }

    /// Notes that the reductions in flight hold `bytes` of staging now.
    pub fn reductions_staged(&self, bytes: usize) {
        self.reductions_staged.fetch_max(bytes, Ordering::Relaxed);
    }

    /// The counters since the last call, resetting them.
    pub fn take(&self) -> StepCounts {
        StepCounts {
            ring: self.ring.take(),
            grads_staged_peak: self.grads_staged.swap(0, Ordering::Relaxed),
            reductions_staged_peak: self.reductions_staged.swap(0, Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_keep_the_largest_report_until_taken() {
        let s = StepStats::default();
        s.grads_staged(30);
        s.grads_staged(10);
        s.reductions_staged(7);
        s.ring
            .sent_bytes
            .fetch_add(5, std::sync::atomic::Ordering::Relaxed);
        let c = s.take();
        assert_eq!(
            (
                c.grads_staged_peak,
                c.reductions_staged_peak,
                c.ring.sent_bytes
            ),
            (30, 7, 5)
        );
        let again = s.take();
        assert_eq!(
            (again.grads_staged_peak, again.reductions_staged_peak),
            (0, 0)
        );
        assert_eq!(again.ring.sent_bytes, 0);
    }
}
