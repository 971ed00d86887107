//! ZeRO stage 1 (Rajbhandari et al. 2020): each data-parallel rank owns the optimizer state of
//! one shard of every gradient bucket. The gradient sync reduce-scatters each bucket so that a
//! rank holds the sum of its own shard ([`super::GradSync`]); the optimizer updates the owned
//! ranges only; [`gather_shards`] all-gathers the updated master weights bucket by bucket.

use std::ops::Range;

use candle_core::{Result, Tensor};

use super::{Bucket, FlatLayout};
use crate::comm::{Comm, Group};

/// A rank's place in the groups its buckets are sharded over: `(index, size)` in the shard
/// group (other buckets) and in the expert shard group (expert buckets, see
/// [`FlatLayout::grouped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardPos {
    /// Index and size in the shard group.
    pub dense: (usize, usize),
    /// Index and size in the expert shard group.
    pub expert: (usize, usize),
}

impl ShardPos {
    /// Index `index` of `size` for every bucket (no expert parallelism).
    pub fn uniform(index: usize, size: usize) -> Self {
        Self {
            dense: (index, size),
            expert: (index, size),
        }
    }

    /// This rank's shard of bucket `b`.
    pub fn shard(&self, b: &Bucket) -> Range<usize> {
        let (i, n) = if b.expert { self.expert } else { self.dense };
        b.shard(i, n)
    }
}

/// The flat ranges whose optimizer state the rank at `pos` owns: with sharding (ZeRO stage 1
/// and above) its shard of each (non-empty) bucket, otherwise the whole buffer.
pub fn owned_ranges(layout: &FlatLayout, sharded: bool, pos: ShardPos) -> Vec<Range<usize>> {
    if sharded {
        layout
            .buckets
            .iter()
            .map(|b| pos.shard(b))
            .filter(|r| !r.is_empty())
            .collect()
    } else {
        std::iter::once(0..layout.total).collect()
    }
}

/// Reassembles the whole flat buffer `[layout.total]` from the shards of every rank of the shard
/// group `shard` (expert buckets: of the expert shard group `expert_shard`). `own` holds this
/// rank's shards of all buckets back to back.
pub fn gather_shards(
    layout: &FlatLayout,
    own: &Tensor,
    comm: &dyn Comm,
    shard: &Group,
    expert_shard: &Group,
) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(layout.buckets.len());
    let mut offset = 0;
    for b in &layout.buckets {
        let group = if b.expert { expert_shard } else { shard };
        let n = b.len / group.size();
        parts.push(comm.all_gather(group, &own.narrow(0, offset, n)?, 0)?); // [len]
        offset += n;
    }
    Tensor::cat(&parts, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sharded_rank_owns_one_shard_per_bucket() {
        let l = FlatLayout::new(&[5, 3, 7, 2], 8, 4);
        let at = ShardPos::uniform;
        assert_eq!(owned_ranges(&l, true, at(3, 4)), vec![6..8, 17..20]);
        assert_eq!(owned_ranges(&l, true, at(0, 4)), vec![0..2, 8..11]);
        // Expert buckets are cut by the expert shard group.
        let g = FlatLayout::grouped(&[5, 3, 7, 2], &[false, true, true, false], 100, [4, 2]);
        let pos = ShardPos {
            dense: (3, 4),
            expert: (1, 2),
        };
        assert_eq!(owned_ranges(&g, true, pos), vec![6..8, 13..18, 21..22]);
        assert_eq!(
            owned_ranges(&l, false, at(0, 4)),
            std::iter::once(0..20).collect::<Vec<_>>()
        );
    }
}
