//! ZeRO stage 1 (Rajbhandari et al. 2020): each data-parallel rank owns the optimizer state of
//! one shard of every gradient bucket. The gradient sync reduce-scatters each bucket so that a
//! rank holds the sum of its own shard ([`super::GradSync`]); the optimizer updates the owned
//! ranges only; [`publish_shards`] all-gathers the updated weights bucket by bucket, in the
//! parameters' dtype.

use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};

use super::{Bucket, FlatLayout};
use crate::comm::{Comm, Group, HandOff};

/// A rank's place in the groups its buckets are sharded over: `(index, size)` in the shard
/// group (other buckets) and in the expert gradient group (expert buckets, see
/// [`FlatLayout::grouped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardPos {
    /// Index and size in the shard group.
    pub dense: (usize, usize),
    /// Index and size in the expert gradient group.
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

/// Hands every parameter its updated values, gathered bucket by bucket from the shards of every
/// rank of the shard group `shard` (expert buckets: of the expert gradient group `expert_grad`).
/// `own` holds this rank's master shards of all buckets back to back (f32, on the parameters'
/// device or, offloaded, the host); each is cast to the parameters' `dtype` first (bf16 on GPUs:
/// half the bytes of gathering f32 masters, and the same values, as the cast is element-wise),
/// moved to `device`, all-gathered, and each parameter of the bucket passed to
/// `write(i, values)` (`values`: `[numel]` in `dtype`). One bucket is gathered at a time, never
/// the whole flat buffer: the transient is a bucket, not the model.
pub fn publish_shards(
    layout: &FlatLayout,
    own: &Tensor,
    to: (DType, &Device),
    groups: (&dyn Comm, &Group, &Group),
    mut write: impl FnMut(usize, &Tensor) -> Result<()>,
) -> Result<()> {
    let mut offset = 0;
    for (b, bucket) in layout.buckets.iter().enumerate() {
        let group = if bucket.expert { groups.2 } else { groups.1 };
        let n = bucket.len / group.size();
        publish_bucket(
            layout,
            b,
            &own.narrow(0, offset, n)?,
            to,
            groups,
            &mut write,
        )?;
        offset += n;
    }
    Ok(())
}

/// [`publish_shards`] of bucket `b` alone, from this rank's master shard `part` of it.
pub fn publish_bucket(
    layout: &FlatLayout,
    b: usize,
    part: &Tensor,
    (dtype, device): (DType, &Device),
    (comm, shard, expert_grad): (&dyn Comm, &Group, &Group),
    mut write: impl FnMut(usize, &Tensor) -> Result<()>,
) -> Result<()> {
    let bucket = &layout.buckets[b];
    let group = if bucket.expert { expert_grad } else { shard };
    let part = moved(&part.to_dtype(dtype)?, device)?; // [len / shards]
    let whole = comm.all_gather(group, &part, 0)?; // [len]
    for i in bucket.params.clone() {
        let r = layout.range(i);
        write(i, &whole.narrow(0, r.start - bucket.start, r.len())?)?;
    }
    Ok(())
}

/// [`publish_shards`] into `flat` `[layout.total]`, the parameters' flat tensor in their dtype
/// in which every parameter lies at its layout offset: each bucket's shard of `own` is written
/// into its place there by `cast(place, masters)` (rounding f32 masters to the parameters'
/// dtype), then the bucket is all-gathered in place. No gathered bucket is allocated and no
/// parameter copied one by one. `own` must be on `flat`'s device.
pub fn publish_shards_into(
    layout: &FlatLayout,
    own: &Tensor,
    flat: &Tensor,
    (comm, shard, expert_grad): (&dyn Comm, &Group, &Group),
    cast: impl Fn(&Tensor, &Tensor) -> Result<()>,
) -> Result<()> {
    if flat.elem_count() != layout.total || !own.device().same_device(flat.device()) {
        candle_core::bail!(
            "publishing into a flat tensor of {} elements on {:?}: expected {} on the masters' \
             device {:?}",
            flat.elem_count(),
            flat.device(),
            layout.total,
            own.device()
        );
    }
    let mut offset = 0;
    for bucket in &layout.buckets {
        let group = if bucket.expert { expert_grad } else { shard };
        let Some(me) = group.index_of(comm.rank()) else {
            candle_core::bail!(
                "publish: rank {} is not in its group {group:?}",
                comm.rank()
            );
        };
        let n = bucket.len / group.size();
        if n == 0 {
            continue;
        }
        let whole = flat.narrow(0, bucket.start, bucket.len)?; // [len]
        cast(&whole.narrow(0, me * n, n)?, &own.narrow(0, offset, n)?)?;
        comm.all_gather_in_place(group, &whole, &HandOff::none())?;
        offset += n;
    }
    Ok(())
}

/// `t`'s values on `device`, copying only them: candle moves the whole storage a view lies in
/// (an offloaded optimizer's flat state, for a bucket's view of it).
pub fn moved(t: &Tensor, device: &Device) -> Result<Tensor> {
    if t.device().same_device(device) {
        return Ok(t.clone());
    }
    t.force_contiguous()?.to_device(device)
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
        // Expert buckets are cut by the expert gradient group.
        let flags = ([false, true, true, false], [false; 4]);
        let g = FlatLayout::grouped(&[5, 3, 7, 2], (&flags.0, &flags.1), 100, [4, 2]);
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
