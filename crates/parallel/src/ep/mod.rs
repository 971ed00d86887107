//! Expert parallelism: the experts of every mixture-of-experts layer split across the ranks of an
//! expert-parallel group, each token's rows carried to the ranks holding its experts and the
//! results carried back, both by all-to-all with variable splits.
//!
//! ```text
//!  rank j: x_perm [n·k, h], rows grouped by global expert (experts of rank 0, of rank 1, …)
//!    ── all-to-all of the per-expert row counts (rank r learns how many rows each member has
//!       for each of its experts)
//!    ── all-to-all: rank j's rows for the experts of rank r go to rank r
//!  rank r: received rows in (source rank, local expert) order
//!    ── regrouped to (local expert, source rank) order: each local expert's rows contiguous
//!    ── the experts run over their rows                        y_local [m, h]
//!    ── back to (source rank, local expert) order, reverse all-to-all
//!  rank j: y_perm [n·k, h], in x_perm's row order
//! ```
//!
//! Both directions have graph-free gradients for the model's hand-written backward pass
//! ([`ExpertParallel::dispatch_grad`], [`ExpertParallel::combine_grad`]): the gradient of a row
//! all-to-all is the reverse all-to-all of the incoming gradient. All exchanges are all-to-alls, which run point to point on the `local` and
//! `tcp` backends and on a communicator of their own with NCCL, never as a collective of the
//! group's ranks: the same ranks can form a data-parallel group whose gradient reductions run
//! at the same time on the communication thread. Every member of the group calls them in the
//! same order (the members run the same pipeline schedule over the same layers), forward and
//! backward, even when it sends or receives no rows, so none waits on a peer that skipped a
//! call.
//!
//! Rank layout and gradient groups: see `mesh.rs` (expert parallelism is folded inside data
//! parallelism; expert gradients are reduced over the expert gradient group).

pub mod register;

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Device, Result, Tensor};

use crate::comm::{Comm, Group};

/// The expert-parallel group of one rank (a one-rank group without expert parallelism, where
/// dispatch and combine are the identity).
#[derive(Clone)]
pub struct ExpertParallel {
    comm: Option<Arc<dyn Comm>>,
    group: Group,
    index: usize,
}

impl std::fmt::Debug for ExpertParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ExpertParallel(index {} of {:?})",
            self.index, self.group
        )
    }
}

/// How the rows of one dispatch were split, for the matching [`ExpertParallel::combine`].
#[derive(Debug, Clone)]
pub struct Dispatch {
    /// Rows sent to each member (this rank's rows for that member's experts).
    send: Vec<usize>,
    /// Rows received from each member.
    recv: Vec<usize>,
    /// Received row of each row in (local expert, source) order; `None` with one rank.
    grouped: Option<Vec<u32>>,
    /// Rows per local expert, in the order the experts are held.
    pub counts: Vec<usize>,
}

impl ExpertParallel {
    /// No expert parallelism: this rank holds every expert.
    pub fn single() -> Self {
        Self {
            comm: None,
            group: Group::new(vec![0]),
            index: 0,
        }
    }

    /// The expert-parallel group `group` of the rank `comm` belongs to.
    pub fn new(comm: Arc<dyn Comm>, group: Group) -> Self {
        let index = group
            .index_of(comm.rank())
            .expect("a rank belongs to its own expert-parallel group");
        Self {
            comm: Some(comm),
            group,
            index,
        }
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's index in the group.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The global experts this rank holds out of `num_experts` (a multiple of the group size):
    /// the `index`-th run of `num_experts / size` consecutive experts.
    pub fn local_experts(&self, num_experts: usize) -> Range<usize> {
        let per = num_experts / self.size();
        self.index * per..(self.index + 1) * per
    }

    /// The gradient of [`ExpertParallel::dispatch`]'s input from that of its output
    /// `dx_local` `[m, h]`: the rows regrouped back to (source, expert) order and returned to
    /// their ranks by the reverse all-to-all, `[n·k, h]`. Every member calls it.
    pub fn dispatch_grad(&self, dx_local: &Tensor, d: &Dispatch) -> Result<Tensor> {
        let (Some(comm), Some(grouped)) = (self.comm.as_ref(), d.grouped.as_ref()) else {
            return Ok(dx_local.clone());
        };
        let index = Tensor::from_vec(received_order(grouped), grouped.len(), dx_local.device())?;
        let g = dx_local.index_select(&index, 0)?; // [m, h], (source, expert) order
        Ok(comm.all_to_all(&self.group, &g, &d.recv, &d.send)?)
    }

    /// Sends the rows of `x` (`[n·k, h]`, grouped by global expert, `counts[e]` rows for expert
    /// `e` of all `E`) to the ranks holding their experts; returns the rows this rank's experts
    /// must process (`[m, h]`, grouped by local expert, with the [`Dispatch`] saying how many
    /// each). With `uniform`, every member has `counts` rows for each expert (experts padded to
    /// one capacity), so the counts are not exchanged.
    pub fn dispatch(
        &self,
        x: &Tensor,
        counts: &[usize],
        uniform: bool,
    ) -> Result<(Tensor, Dispatch)> {
        let (n, e) = (self.size(), counts.len());
        let Some(comm) = self.comm.as_ref().filter(|_| n > 1) else {
            let d = Dispatch {
                send: vec![x.dim(0)?],
                recv: vec![x.dim(0)?],
                grouped: None,
                counts: counts.to_vec(),
            };
            return Ok((x.clone(), d));
        };
        if !e.is_multiple_of(n) {
            candle_core::bail!("expert parallelism: {e} experts do not split over {n} ranks");
        }
        let per = e / n;
        let mine: Vec<u32> = counts
            .iter()
            .map(|&c| u32::try_from(c).map_err(candle_core::Error::wrap))
            .collect::<Result<_>>()?;
        // Each member's counts for this rank's experts: [n, per]. Exchanged by all-to-all (each
        // member gets the counts of its own experts), like the rows: collectives over the same
        // ranks may be running on the data-parallel communication thread. Uniform counts are
        // every member's alike.
        let got = if uniform {
            // Every member routes micro-batches of one shape, so one capacity: its counts for
            // this rank's experts are this rank's own.
            if mine.windows(2).any(|w| w[0] != w[1]) {
                candle_core::bail!("expert parallelism: uniform rows, but {counts:?} per expert");
            }
            mine[self.local_experts(e)].repeat(n)
        } else {
            let split = vec![per; n];
            let theirs = Tensor::from_vec(mine, (e, 1), &Device::Cpu)?;
            comm.all_to_all(&self.group, &theirs, &split, &split)?
                .to_device(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<u32>()?
        };
        let from: Vec<&[u32]> = got.chunks(per).collect(); // from[j][l]
        let send: Vec<usize> = counts.chunks(per).map(|c| c.iter().sum()).collect();
        let recv: Vec<usize> = from
            .iter()
            .map(|row| row.iter().map(|&c| c as usize).sum())
            .collect();
        // Received blocks come in (source, local expert) order; regroup to (local expert, source).
        let mut starts = vec![vec![0usize; per]; n]; // first received row of block (source, expert)
        let mut at = 0;
        for (j, row) in from.iter().enumerate() {
            for (l, &c) in row.iter().enumerate() {
                starts[j][l] = at;
                at += c as usize;
            }
        }
        let mut grouped = Vec::with_capacity(at);
        let mut local_counts = vec![0usize; per];
        for (l, total) in local_counts.iter_mut().enumerate() {
            for (j, row) in from.iter().enumerate() {
                let c = row[l] as usize;
                grouped.extend((starts[j][l]..starts[j][l] + c).map(|r| r as u32));
                *total += c;
            }
        }
        let received = comm.all_to_all(&self.group, x, &send, &recv)?; // [m, h], (source, expert) order
        let index = Tensor::from_vec(grouped.clone(), grouped.len(), x.device())?;
        let x_local = received.index_select(&index, 0)?; // [m, h], (expert, source) order
        let d = Dispatch {
            send,
            recv,
            grouped: Some(grouped),
            counts: local_counts,
        };
        Ok((x_local, d))
    }

    /// The gradient of [`ExpertParallel::combine`]'s input from that of its output `dy`
    /// `[n·k, h]`: the rows sent back to the experts' ranks by the reverse all-to-all and
    /// regrouped to (local expert, source) order, `[m, h]`. Every member calls it.
    pub fn combine_grad(&self, dy: &Tensor, d: &Dispatch) -> Result<Tensor> {
        let (Some(comm), Some(grouped)) = (self.comm.as_ref(), d.grouped.as_ref()) else {
            return Ok(dy.clone());
        };
        let g = comm.all_to_all(&self.group, dy, &d.send, &d.recv)?; // [m, h], (source, expert)
        let index = Tensor::from_vec(grouped.clone(), grouped.len(), dy.device())?;
        g.index_select(&index, 0)
    }

    /// Returns the experts' outputs `y` (`[m, h]`, rows as [`ExpertParallel::dispatch`] gave
    /// them) to the ranks their tokens came from: `[n·k, h]` in the dispatched `x`'s row order.
    pub fn combine(&self, y: &Tensor, d: &Dispatch) -> Result<Tensor> {
        let (Some(comm), Some(grouped)) = (self.comm.as_ref(), d.grouped.as_ref()) else {
            return Ok(y.clone());
        };
        let index = Tensor::from_vec(received_order(grouped), grouped.len(), y.device())?;
        let y = y.index_select(&index, 0)?; // [m, h], (source, expert) order
        Ok(comm.all_to_all(&self.group, &y, &d.recv, &d.send)?)
    }
}

/// The inverse of the regrouping permutation `grouped` (row `i` of the (expert, source) order is
/// received row `grouped[i]`): the (expert, source) row of each received row.
fn received_order(grouped: &[u32]) -> Vec<u32> {
    let mut received = vec![0u32; grouped.len()];
    for (row, &r) in grouped.iter().enumerate() {
        received[r as usize] = row as u32;
    }
    received
}
