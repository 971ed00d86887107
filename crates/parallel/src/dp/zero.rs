//! ZeRO stage 1 (Rajbhandari et al. 2020): each data-parallel rank owns the optimizer state of
//! one shard of every gradient bucket. The gradient sync reduce-scatters each bucket so that a
//! rank holds the sum of its own shard ([`super::GradSync`]); the optimizer updates the owned
//! ranges only; [`gather_shards`] all-gathers the updated master weights bucket by bucket.

use std::ops::Range;

use candle_core::{Result, Tensor};

use super::FlatLayout;
use crate::comm::{Comm, Group};

/// The flat ranges whose optimizer state rank `shard_index` of a shard group of `shard_size`
/// owns: with sharding (ZeRO stage 1 and above) its shard of each (non-empty) bucket, otherwise
/// the whole buffer.
pub fn owned_ranges(
    layout: &FlatLayout,
    sharded: bool,
    shard_index: usize,
    shard_size: usize,
) -> Vec<Range<usize>> {
    if sharded {
        layout
            .buckets
            .iter()
            .map(|b| b.shard(shard_index, shard_size))
            .filter(|r| !r.is_empty())
            .collect()
    } else {
        std::iter::once(0..layout.total).collect()
    }
}

/// Reassembles the whole flat buffer `[layout.total]` from the shards of every rank of the shard
/// group `shard`. `own` holds this rank's shards of all buckets back to back
/// (`[layout.total / shard.size()]`).
pub fn gather_shards(
    layout: &FlatLayout,
    own: &Tensor,
    comm: &dyn Comm,
    shard: &Group,
) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(layout.buckets.len());
    let mut offset = 0;
    for b in &layout.buckets {
        let n = b.len / shard.size();
        parts.push(comm.all_gather(shard, &own.narrow(0, offset, n)?, 0)?); // [len]
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
        assert_eq!(owned_ranges(&l, true, 3, 4), vec![6..8, 17..20]);
        assert_eq!(owned_ranges(&l, true, 0, 4), vec![0..2, 8..11]);
        assert_eq!(
            owned_ranges(&l, false, 0, 4),
            std::iter::once(0..20).collect::<Vec<_>>()
        );
    }
}
