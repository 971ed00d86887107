//! Context parallelism: the sequence of every sample split across the ranks of a context-parallel
//! group, with attention computed by a ring that rotates keys and values among them.
//!
//! **Load-balanced split.** A sequence of `s` tokens is cut into `2·cp` chunks of `c = s / (2·cp)`;
//! cp rank `r` holds chunks `r` and `2·cp − 1 − r`, in that order, as its local sequence of `2c`
//! tokens. Under a causal mask a chunk's work grows with its position, so pairing an early chunk
//! with its mirror image gives every rank the same work. Tokens, labels, loss mask and RoPE
//! positions (global positions) are split the same way ([`ContextParallel::split_rows`],
//! [`ContextParallel::positions`]).
//!
//! **What crosses ranks.** Only attention needs other ranks' tokens ([`ring`]): everything else in
//! a decoder block is per token. Weights are replicated across the cp group, so their gradients
//! are reduced over data-parallel × context-parallel ranks, and the loss is normalised by the
//! token count of the whole global batch (the training loop's concern; see `RankCtx`).
//!
//! A model always has a [`ContextParallel`]; with one rank it is the identity and attention runs
//! the plain causal kernel, so the model has one path for every layout.

pub mod documents;
pub mod register;
pub mod ring;

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{Result, Tensor};

use crate::comm::{Comm, Group};
use crate::stats::StepStats;

pub use documents::{DocumentStarts, Floor};
pub use ring::Kernels;

/// Nanosecond counters of the ring's communication: part of the rank's
/// [`StepStats`](crate::stats::StepStats), shared by the clones of one [`ContextParallel`].
#[derive(Debug, Default)]
pub struct RingStats {
    /// Time spent blocked in `recv` waiting for a neighbour's K/V (or dK/dV) block.
    pub wait_ns: AtomicU64,
    /// Time spent in `send` (handing a block to the backend: a copy on thread ranks, an enqueue
    /// on NCCL, where these host times say nothing of the device's and the trainer drops them).
    pub send_ns: AtomicU64,
    /// Time spent in the ring attention ops in all (compute and communication).
    pub total_ns: AtomicU64,
    /// Bytes sent to the next rank.
    pub sent_bytes: AtomicU64,
    /// Blocks whose computation was skipped: no query may see their keys (documents kept apart).
    pub skipped_blocks: AtomicU64,
}

impl RingStats {
    /// The counters since the last call, resetting them.
    pub fn take(&self) -> RingTotals {
        let secs = |c: &AtomicU64| c.swap(0, Ordering::Relaxed) as f64 * 1e-9;
        RingTotals {
            wait_s: secs(&self.wait_ns),
            send_s: secs(&self.send_ns),
            total_s: secs(&self.total_ns),
            sent_bytes: self.sent_bytes.swap(0, Ordering::Relaxed),
            skipped_blocks: self.skipped_blocks.swap(0, Ordering::Relaxed),
        }
    }
}

/// What [`RingStats::take`] returns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RingTotals {
    /// Seconds blocked waiting for a neighbour's block.
    pub wait_s: f64,
    /// Seconds spent handing blocks to the backend.
    pub send_s: f64,
    /// Seconds in the ring attention ops (compute and communication).
    pub total_s: f64,
    /// Bytes sent to the next rank.
    pub sent_bytes: u64,
    /// Blocks skipped (forward and backward).
    pub skipped_blocks: u64,
}

/// One rank's context-parallel group.
#[derive(Clone)]
pub struct ContextParallel {
    /// The job's communicator (absent for a one-rank group outside any job).
    comm: Option<Arc<dyn Comm>>,
    /// The ranks sharing this rank's samples, ordered by cp index.
    group: Group,
    /// This rank's index in `group`.
    index: usize,
    /// The rank's counters, which the ring reports to.
    stats: Arc<StepStats>,
}

impl std::fmt::Debug for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ContextParallel({} of {:?})", self.index, self.group)
    }
}

impl ContextParallel {
    /// The context-parallel group `group` of this rank of `comm`, reporting the ring's
    /// communication to `stats`.
    ///
    /// # Panics
    /// If the rank is not in `group` (a programming error).
    pub fn new(comm: Arc<dyn Comm>, group: Group, stats: Arc<StepStats>) -> Self {
        let index = group
            .index_of(comm.rank())
            .expect("a rank belongs to its own context-parallel group");
        Self {
            comm: Some(comm),
            group,
            index,
            stats,
        }
    }

    /// No context parallelism: a one-rank group.
    pub fn single() -> Self {
        Self {
            comm: None,
            group: Group::new(vec![0]),
            index: 0,
            stats: Arc::default(),
        }
    }

    /// Degree of context parallelism.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's index in the group.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The rows of a full sequence of `seq_len` this rank holds, as two ranges of global positions
    /// (chunks `r` and `2·cp − 1 − r`); one range `0..seq_len` without context parallelism.
    /// `seq_len` must divide by `2·cp` (checked by the recipe; an error here).
    pub fn chunks(&self, seq_len: usize) -> Result<Vec<Range<usize>>> {
        local_chunks(seq_len, self.size(), self.index)
    }

    /// Global positions of this rank's local rows of a sequence of `seq_len`.
    pub fn positions(&self, seq_len: usize) -> Result<Vec<usize>> {
        Ok(self.chunks(seq_len)?.into_iter().flatten().collect())
    }

    /// This rank's rows of `t` along `dim` (of size `seq_len`): the two chunks concatenated.
    pub fn split_rows(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        if self.size() == 1 {
            return Ok(t.clone());
        }
        let parts = self
            .chunks(t.dim(dim)?)?
            .into_iter()
            .map(|r| t.narrow(dim, r.start, r.len()))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, dim)
    }

    /// The rows of the rotary tables `cos`, `sin` `[max_pos, d / 2]` for this rank's local rows of
    /// a full sequence of `seq_len` (global positions).
    pub fn rope_rows(
        &self,
        cos: &Tensor,
        sin: &Tensor,
        seq_len: usize,
    ) -> Result<(Tensor, Tensor)> {
        if self.size() == 1 {
            return Ok((cos.narrow(0, 0, seq_len)?, sin.narrow(0, 0, seq_len)?));
        }
        Ok((
            self.split_rows(&cos.narrow(0, 0, seq_len)?, 0)?,
            self.split_rows(&sin.narrow(0, 0, seq_len)?, 0)?,
        ))
    }

    /// Causal attention of this rank's local queries `q` `[b, 2c, hq, d]` over the whole
    /// sequence, whose keys and values `k`, `v` `[b, 2c, hkv, d]` are spread over the group:
    /// `kernels.causal` with one rank, the ring of [`ring`] otherwise. Returns the output
    /// `[b, 2c, hq, d]` (the kernel's dtype with one rank, that of `q` from the ring) and its
    /// log-sum-exp `[b, hq, 2c]` in the accumulation dtype, which
    /// [`ContextParallel::attention_bwd`] reads. With `docs`, every query sees only the keys of
    /// its own document.
    pub fn attention(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        scale: f64,
        kernels: Kernels,
        docs: Option<&DocumentStarts>,
    ) -> Result<(Tensor, Tensor)> {
        match self.ring(scale, kernels, docs) {
            Some(ring) => ring::attention(&ring, q, k, v),
            None => (kernels.causal)(q, k, v, scale, docs.map(|d| d.starts())),
        }
    }

    /// The gradients `(dq, dk, dv)` of [`ContextParallel::attention`] (in the dtypes of `q`,
    /// `k`, `v`) from its output and log-sum-exp `saved` and the output's gradient `dout`
    /// `[b, 2c, hq, d]`: the kernel's backward with one rank, the ring's otherwise.
    pub fn attention_bwd(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        saved: (&Tensor, &Tensor),
        dout: &Tensor,
        scale: f64,
        kernels: Kernels,
        docs: Option<&DocumentStarts>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        match self.ring(scale, kernels, docs) {
            Some(ring) => ring::attention_bwd(&ring, (q, k, v), saved, dout),
            None => (kernels.causal_bwd)(q, k, v, saved, dout, scale, docs.map(|d| d.starts())),
        }
    }

    /// The ring of a group of more than one rank.
    fn ring(
        &self,
        scale: f64,
        kernels: Kernels,
        docs: Option<&DocumentStarts>,
    ) -> Option<ring::Ring> {
        let comm = self.comm.as_ref().filter(|_| self.size() > 1)?;
        Some(ring::Ring {
            comm: comm.clone(),
            group: self.group.clone(),
            index: self.index,
            kernels,
            scale,
            stats: self.stats.clone(),
            docs: docs.cloned(),
        })
    }
}

/// See [`ContextParallel::chunks`]: the rows of cp rank `r` of `cp` in a sequence of `seq_len`.
pub fn local_chunks(seq_len: usize, cp: usize, r: usize) -> Result<Vec<Range<usize>>> {
    if cp <= 1 {
        return Ok(std::iter::once(0..seq_len).collect());
    }
    if !seq_len.is_multiple_of(2 * cp) {
        candle_core::bail!(
            "context parallelism cp = {cp} needs the sequence length to divide by 2·cp = {}, \
             got {seq_len}",
            2 * cp
        )
    }
    let c = seq_len / (2 * cp);
    let mirror = 2 * cp - 1 - r;
    Ok(vec![r * c..(r + 1) * c, mirror * c..(mirror + 1) * c])
}
