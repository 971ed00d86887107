//! Where a rank's gradients and optimizer state live at its ZeRO stage: the flat layout of its
//! parameters and the flat ranges it owns ([`StateLayout`]), built alike by the trainer (from the
//! allocated model) and by the planner (from the parameter list alone).
//!
//! **Buckets.** Stages 0 and 1 cut the flat buffer into buckets by size (`parallel.bucket_size`),
//! for overlapped data-parallel reduction. Stages 2 and 3 reduce-scatter (and gather) per model
//! piece, so a bucket is a run of consecutive parameters first used by the same piece
//! ([`unit_buckets`]): the embedding, each decoder block, the final norm with an untied output
//! matrix. A piece that also reads another piece's parameter (the tied output matrix is the
//! embedding) needs that bucket too.

use std::ops::Range;

use candle_core::DType;

use super::{owned_ranges, FlatLayout, ShardPos, StateBytes};
use crate::ParallelConfig;

/// The buckets of ZeRO stages 2 and 3 for `n` parameters: runs of consecutive parameters first
/// used by the same piece (`piece_params[k]`: the parameters piece `k` reads, pieces in
/// execution order); with `split_experts`, a piece's routed experts (`expert[i]`) form a bucket
/// of their own (they are sharded over another group).
pub fn unit_buckets(
    n: usize,
    piece_params: &[Vec<usize>],
    expert: &[bool],
    split_experts: bool,
) -> Vec<Range<usize>> {
    let mut owner = vec![usize::MAX; n];
    for (k, params) in piece_params.iter().enumerate() {
        for &i in params {
            if owner[i] == usize::MAX {
                owner[i] = k;
            }
        }
    }
    let same_kind = |a: usize, b: usize| !split_experts || expert[a] == expert[b];
    let mut out: Vec<Range<usize>> = Vec::new();
    for i in 0..n {
        match out.last_mut() {
            Some(r) if owner[r.start] == owner[i] && same_kind(r.start, i) => r.end = i + 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

/// Where a rank's gradients and optimizer state live: the flat layout of its parameters and the
/// flat ranges it owns.
#[derive(Debug, Clone)]
pub struct StateLayout {
    /// Buckets by size (stages 0, 1) or by piece (2, 3), padded for the shard group.
    pub layout: FlatLayout,
    /// The flat ranges whose optimizer state (and, at stages 2 and 3, gradients) this rank keeps.
    pub owned: Vec<Range<usize>>,
}

/// Elements a bucket's and a shard's length is a multiple of: 16 bytes of a 16-bit dtype.
pub const ALIGN: usize = 8;

impl StateLayout {
    /// The layout of a rank at data-parallel shard index `shard_index` (and `expert_index` in
    /// its expert gradient group) under `par`, holding parameters of local sizes `numels` (in
    /// construction order) read by the pieces `piece_params` (see [`unit_buckets`]), `expert[i]`
    /// for a routed expert's, `joined[i]` where parameter `i` stays in the bucket of `i + 1`
    /// (see [`FlatLayout::grouped`]). With expert parallelism the experts' parameters get buckets
    /// of their own, sharded over the expert gradient group.
    pub fn new(
        par: &ParallelConfig,
        numels: &[usize],
        piece_params: &[Vec<usize>],
        (expert, joined): (&[bool], &[bool]),
        shard_index: usize,
        expert_index: usize,
    ) -> Self {
        let (zero, shard) = (par.zero, par.shard_size());
        // Stage 0 pads buckets for the data-parallel size (as always); sharded stages for the
        // shard group.
        let (pad, expert_pad) = if zero.shards_optimizer() {
            (shard, par.expert_grad_ranks())
        } else {
            (par.dp, par.dp / par.ep)
        };
        let split = par.ep > 1;
        let none = vec![false; numels.len()];
        let expert = if split { expert } else { &none };
        // Every bucket and every member's shard of it is a whole number of `ALIGN` elements, so
        // each starts 16-byte aligned for the kernels' packed loads (with a dp of 3 a bucket
        // padded to a multiple of 3 alone would leave the parameters after it unaligned).
        let pads = [pad * ALIGN, expert_pad * ALIGN];
        let layout = if zero.shards_gradients() {
            let buckets = unit_buckets(numels.len(), piece_params, expert, split);
            FlatLayout::with_grouped_buckets(numels, &buckets, expert, pads)
        } else {
            FlatLayout::grouped(numels, (expert, joined), par.bucket_size, pads)
        };
        let pos = ShardPos {
            dense: (shard_index, shard),
            expert: (expert_index, par.expert_grad_ranks()),
        };
        let owned = owned_ranges(&layout, zero.shards_optimizer(), pos);
        Self { layout, owned }
    }

    /// Elements this rank owns.
    pub fn owned_elems(&self) -> usize {
        self.owned.iter().map(|r| r.len()).sum()
    }

    /// Elements this rank owns of the parameters flagged in `flags`.
    pub fn owned_of(&self, flags: &[bool]) -> usize {
        let l = &self.layout;
        (0..flags.len())
            .filter(|&i| flags[i])
            .flat_map(|i| {
                self.owned
                    .iter()
                    .map(move |r| super::intersect(&l.range(i), r).len())
            })
            .sum()
    }

    /// The bytes of parameters (`numels`, in `dtype`), fp32 gradients and the AdamW state (fp32
    /// master weights, moments in `moments`) this layout gives a rank under `par`
    /// ([`super::ZeroStage::state_bytes`]).
    pub fn bytes(
        &self,
        par: &ParallelConfig,
        numels: &[usize],
        dtype: DType,
        moments: DType,
    ) -> StateBytes {
        let params = numels.iter().sum();
        let (flat, owned) = (self.layout.total, self.owned_elems());
        let (p, m) = (dtype.size_in_bytes(), moments.size_in_bytes());
        par.zero.state_bytes(params, flat, owned, p, m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dp::ZeroStage;

    /// With data-parallel sizes that are not powers of two, every bucket, every parameter after
    /// it and every rank's shard still start on a multiple of [`ALIGN`] elements, at every
    /// stage (bucketed by size or by piece).
    #[test]
    fn buckets_and_shards_start_aligned_for_any_data_parallel_size() {
        // Parameters of whole packs, bucketed a few at a time.
        let numels = [24, 8, 40, 16, 8, 64, 32, 8];
        let pieces: Vec<Vec<usize>> = vec![vec![0, 1, 2], vec![3, 4], vec![5, 6, 7]];
        let none = vec![false; numels.len()];
        for dp in [1, 3, 5, 6, 7, 12] {
            for zero in [ZeroStage::Off, ZeroStage::Optimizer, ZeroStage::Gradients] {
                let par = ParallelConfig {
                    dp,
                    zero,
                    bucket_size: 50,
                    ..ParallelConfig::default()
                };
                for index in 0..dp {
                    let s = StateLayout::new(&par, &numels, &pieces, (&none, &none), index, 0);
                    let l = &s.layout;
                    let starts = l.buckets.iter().map(|b| b.start);
                    let owned = s.owned.iter().map(|r| r.start);
                    for at in starts.chain(l.offsets.iter().copied()).chain(owned) {
                        assert_eq!(at % ALIGN, 0, "dp {dp} {zero:?} rank {index}: {at}");
                    }
                    assert!(l
                        .buckets
                        .iter()
                        .all(|b| b.len % (ALIGN * par.shard_size()) == 0));
                }
            }
        }
    }
}
