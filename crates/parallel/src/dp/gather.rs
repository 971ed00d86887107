//! ZeRO-3 parameter gathering: installs the full parameters of the model piece being computed
//! and releases them after its use.
//!
//! A rank keeps only its shards of each parameter ([`super::DataParallel`] holds them); before a
//! piece's forward, and again before its backward, [`Gatherer::before`] installs the piece's
//! buckets (all-gathered on the communication thread) in the model's parameter slots
//! ([`ParamSlots`]), and [`Gatherer::after`] releases them unless the next use reads them. The
//! next use's buckets are gathered ahead while the current piece computes, so at most the
//! current piece's and the next piece's parameters are live (FSDP's reshard-after-forward). The
//! pieces' tapes hold no parameters, so releasing after the forward frees the memory whatever the
//! recompute mode; the backward gathers them again.

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::hash::Hash;
use std::time::Instant;

use candle_core::{Result, Tensor};

use super::{DataParallel, FlatLayout};
use crate::comm::thread::Ticket;

/// The model's parameter slots, which hold a parameter's full tensor only while it is installed.
pub trait ParamSlots {
    /// Installs parameter `i` from elements `offset..` of the gathered bucket `bucket` (flat,
    /// any dtype; the slot casts and shapes them, or keeps a view where it can).
    fn install(&self, i: usize, bucket: &Tensor, offset: usize) -> Result<()>;
    /// Releases parameter `i`.
    fn release(&self, i: usize);
}

/// Whether a piece's use is its forward or its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward.
    Forward,
    /// Backward (which re-runs the forward first under recompute).
    Backward,
}

/// What the gathers of a pass cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GatherStats {
    /// Seconds the communication thread spent all-gathering parameters.
    pub gather_s: f64,
    /// Seconds the compute thread waited for a gather.
    pub wait_s: f64,
    /// Most bytes of full parameters live at once (installed or gathered ahead).
    pub peak_bytes: usize,
}

/// ZeRO-3's gatherer over pieces `P` (see the module docs).
pub struct Gatherer<P> {
    layout: FlatLayout,
    /// Bytes per element of the training dtype.
    elem: usize,
    /// The buckets each piece reads.
    needs: HashMap<P, Vec<usize>>,
    /// The pass's piece uses `(piece, micro-batch, pass)`, for gathering one ahead.
    plan: Vec<(P, usize, Pass)>,
    next: usize,
    /// Installed buckets.
    installed: HashSet<usize>,
    /// Gathers submitted ahead of their use.
    ahead: HashMap<usize, Ticket<(Tensor, f64)>>,
    stats: GatherStats,
}

impl<P: Copy + Eq + Hash + Debug> Gatherer<P> {
    /// A gatherer for parameters laid out by `layout` (`elem` bytes per element), piece `p`
    /// reading the buckets `needs[p]`.
    pub fn new(layout: FlatLayout, elem: usize, needs: HashMap<P, Vec<usize>>) -> Self {
        Self {
            layout,
            elem,
            needs,
            plan: Vec::new(),
            next: 0,
            installed: HashSet::new(),
            ahead: HashMap::new(),
            stats: GatherStats::default(),
        }
    }

    /// Begins a pass whose piece uses are `plan`.
    pub fn start(&mut self, plan: Vec<(P, usize, Pass)>) {
        self.plan = plan;
        self.next = 0;
        self.stats = GatherStats::default();
    }

    /// The costs of the pass so far.
    pub fn stats(&self) -> GatherStats {
        self.stats
    }

    /// Before a use of `piece`: installs its buckets in `slots` (waiting for gathers started
    /// ahead, starting the others), then gathers the next use's ahead.
    pub fn before(
        &mut self,
        slots: &dyn ParamSlots,
        dp: &DataParallel,
        at: (P, usize, Pass),
    ) -> Result<()> {
        if self.plan.get(self.next) == Some(&at) {
            self.next += 1;
        }
        for b in self.needs_of(at.0)?.to_vec() {
            if !self.installed.contains(&b) {
                let ticket = match self.ahead.remove(&b) {
                    Some(t) => t,
                    None => dp.gather(b)?,
                };
                let waited = Instant::now();
                let (full, secs) = ticket.wait()?;
                self.stats.wait_s += waited.elapsed().as_secs_f64();
                self.stats.gather_s += secs;
                self.install(slots, b, &full)?;
            }
        }
        if let Some(&(next, _, _)) = self.plan.get(self.next) {
            for b in self.needs_of(next)?.to_vec() {
                if !self.installed.contains(&b) && !self.ahead.contains_key(&b) {
                    self.ahead.insert(b, dp.gather(b)?);
                }
            }
        }
        self.track();
        Ok(())
    }

    /// After a use of `piece`: releases its buckets unless the next use reads them.
    pub fn after(&mut self, slots: &dyn ParamSlots, piece: P) -> Result<()> {
        let next: HashSet<usize> = match self.plan.get(self.next) {
            Some(&(p, _, _)) => self.needs_of(p)?.iter().copied().collect(),
            None => HashSet::new(),
        };
        for b in self.needs_of(piece)?.to_vec() {
            if !next.contains(&b) && self.installed.remove(&b) {
                self.release(slots, b);
            }
        }
        Ok(())
    }

    /// Releases everything (end of a pass) and waits for gathers still in flight.
    pub fn finish(&mut self, slots: &dyn ParamSlots) -> Result<()> {
        for (_, t) in self.ahead.drain() {
            t.wait()?;
        }
        for b in std::mem::take(&mut self.installed) {
            self.release(slots, b);
        }
        Ok(())
    }

    fn needs_of(&self, piece: P) -> Result<&[usize]> {
        match self.needs.get(&piece) {
            Some(b) => Ok(b),
            None => candle_core::bail!("ZeRO-3: piece {piece:?} is not on this rank"),
        }
    }

    fn install(&mut self, slots: &dyn ParamSlots, b: usize, full: &Tensor) -> Result<()> {
        let bucket = &self.layout.buckets[b];
        for i in bucket.params.clone() {
            let r = self.layout.range(i);
            slots.install(i, full, r.start - bucket.start)?;
        }
        self.installed.insert(b);
        Ok(())
    }

    fn release(&self, slots: &dyn ParamSlots, b: usize) {
        for i in self.layout.buckets[b].params.clone() {
            slots.release(i);
        }
    }

    /// Updates the peak of live full-parameter bytes.
    fn track(&mut self) {
        let live: usize = self
            .installed
            .iter()
            .chain(self.ahead.keys())
            .map(|&b| self.layout.buckets[b].len * self.elem)
            .sum();
        self.stats.peak_bytes = self.stats.peak_bytes.max(live);
    }
}
