//! `FlatLayout`: where every parameter's gradient (and optimizer state) lives in one flat fp32
//! buffer, cut into buckets for data-parallel communication.
//!
//! Parameters are laid out back to back in model order; consecutive parameters are grouped into
//! buckets — of about `bucket_elems` elements ([`FlatLayout::new`]), or given ranges such as
//! the parameters of one model piece ([`FlatLayout::with_buckets`], ZeRO-2/3) — and each bucket is
//! padded to a multiple of the shard count so that it reduce-scatters into equal shards (see
//! `zero.rs`). Padding elements stay zero.
//!
//! Under expert parallelism a bucket holds either only routed experts' parameters or none
//! ([`FlatLayout::grouped`]): expert buckets are reduced (and sharded) over the expert gradient
//! group, the others over the whole gradient group.

use std::ops::Range;

/// One bucket: a contiguous range of parameters and of the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Parameter indices in the bucket.
    pub params: Range<usize>,
    /// First flat element.
    pub start: usize,
    /// Elements including padding (a multiple of the data-parallel size).
    pub len: usize,
    /// Holds routed experts' parameters (reduced over the expert gradient group).
    pub expert: bool,
}

impl Bucket {
    /// Flat range of data-parallel rank `dp_index`'s shard of the bucket.
    pub fn shard(&self, dp_index: usize, dp_size: usize) -> Range<usize> {
        let n = self.len / dp_size;
        self.start + dp_index * n..self.start + (dp_index + 1) * n
    }
}

/// Offsets of parameters and buckets in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatLayout {
    /// Start of each parameter.
    pub offsets: Vec<usize>,
    /// Elements of each parameter.
    pub numels: Vec<usize>,
    /// The buckets, in flat order.
    pub buckets: Vec<Bucket>,
    /// Total elements including padding.
    pub total: usize,
}

impl FlatLayout {
    /// Lays out parameters of `numels` elements into buckets of at least `bucket_elems` elements
    /// (the last may be smaller), each padded to a multiple of `dp_size`.
    pub fn new(numels: &[usize], bucket_elems: usize, dp_size: usize) -> Self {
        let none = vec![false; numels.len()];
        Self::grouped(numels, (&none, &none), bucket_elems, [dp_size; 2])
    }

    /// [`FlatLayout::new`] where parameter `i` is a routed expert's if `expert[i]`: a bucket
    /// also ends where that changes, and is padded to a multiple of `pad[0]` (others) or
    /// `pad[1]` (experts); and never ends after parameter `i` while `joined[i]` (the weights
    /// a fused GEMM reads back to back: q, k, v; gate, up).
    pub fn grouped(
        numels: &[usize],
        (expert, joined): (&[bool], &[bool]),
        bucket_elems: usize,
        pad: [usize; 2],
    ) -> Self {
        let mut offsets = Vec::with_capacity(numels.len());
        let mut buckets = Vec::new();
        let (mut total, mut first, mut filled) = (0, 0, 0);
        for (i, &n) in numels.iter().enumerate() {
            offsets.push(total + filled);
            filled += n;
            let last = i + 1 == numels.len();
            let full = filled >= bucket_elems && !joined.get(i).copied().unwrap_or(false);
            if full || last || expert[i + 1] != expert[i] {
                let pad = pad[usize::from(expert[i])];
                let len = filled.div_ceil(pad) * pad;
                buckets.push(Bucket {
                    params: first..i + 1,
                    start: total,
                    len,
                    expert: expert[i],
                });
                total += len;
                first = i + 1;
                filled = 0;
            }
        }
        Self {
            offsets,
            numels: numels.to_vec(),
            buckets,
            total,
        }
    }

    /// Lays out parameters of `numels` elements with one bucket per range of parameter indices in
    /// `buckets` (consecutive, covering every parameter; e.g. the parameters of one model piece),
    /// each padded to a multiple of `pad`.
    pub fn with_buckets(numels: &[usize], buckets: &[Range<usize>], pad: usize) -> Self {
        Self::with_grouped_buckets(numels, buckets, &vec![false; numels.len()], [pad; 2])
    }

    /// [`FlatLayout::with_buckets`] where parameter `i` is a routed expert's if `expert[i]`
    /// (each given bucket holds only experts' parameters or none): padded to a multiple of
    /// `pad[0]` (others) or `pad[1]` (experts).
    pub fn with_grouped_buckets(
        numels: &[usize],
        buckets: &[Range<usize>],
        expert: &[bool],
        pad: [usize; 2],
    ) -> Self {
        let mut offsets = Vec::with_capacity(numels.len());
        let mut out = Vec::with_capacity(buckets.len());
        let mut total = 0;
        for params in buckets {
            let start = total;
            for &n in &numels[params.clone()] {
                offsets.push(total);
                total += n;
            }
            let is_expert = expert[params.start];
            let pad = pad[usize::from(is_expert)];
            let len = (total - start).div_ceil(pad) * pad;
            out.push(Bucket {
                params: params.clone(),
                start,
                len,
                expert: is_expert,
            });
            total = start + len;
        }
        Self {
            offsets,
            numels: numels.to_vec(),
            buckets: out,
            total,
        }
    }

    /// Flat range of parameter `i`.
    pub fn range(&self, i: usize) -> Range<usize> {
        self.offsets[i]..self.offsets[i] + self.numels[i]
    }

    /// Index of the bucket holding parameter `i`.
    pub fn bucket_of(&self, i: usize) -> usize {
        self.buckets
            .iter()
            .position(|b| b.params.contains(&i))
            .expect("every parameter is in a bucket")
    }
}

/// The overlap of two ranges (possibly empty).
pub fn intersect(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    a.start.max(b.start)..a.end.min(b.end).max(a.start.max(b.start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_padded_and_cover_everything() {
        let l = FlatLayout::new(&[5, 3, 7, 2], 8, 4);
        assert_eq!(l.offsets, vec![0, 5, 8, 15]);
        assert_eq!(
            l.buckets[0],
            Bucket {
                params: 0..2,
                start: 0,
                len: 8,
                expert: false,
            }
        );
        assert_eq!(
            l.buckets[1],
            Bucket {
                params: 2..4,
                start: 8,
                len: 12,
                expert: false,
            }
        );
        assert_eq!(l.total, 20);
        assert_eq!(l.bucket_of(3), 1);
        assert_eq!(l.buckets[1].shard(1, 4), 11..14);
        assert_eq!(intersect(&(0..5), &(3..9)), 3..5);
        assert!(intersect(&(0..2), &(3..9)).is_empty());
    }

    /// A bucket that fills up inside a joined run (parameter 1 joined with 2, 2 with 3) ends
    /// only after it.
    #[test]
    fn buckets_never_end_inside_a_joined_run() {
        let (expert, joined) = ([false; 5], [false, true, true, false, false]);
        let l = FlatLayout::grouped(&[5, 3, 7, 2, 4], (&expert, &joined), 8, [4, 4]);
        let params: Vec<_> = l.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(params, vec![0..4, 4..5]);
        assert_eq!((l.buckets[0].len, l.total), (20, 24));
        let plain = FlatLayout::new(&[5, 3, 7, 2, 4], 8, 4);
        let cut: Vec<_> = plain.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(
            cut,
            vec![0..2, 2..4, 4..5],
            "without the flags the first run is cut"
        );
    }

    #[test]
    fn given_buckets_are_padded_one_by_one() {
        let l = FlatLayout::with_buckets(&[5, 3, 7, 2], &[0..1, 1..3, 3..4], 4);
        assert_eq!(l.offsets, vec![0, 8, 11, 20]);
        let spans: Vec<(usize, usize)> = l.buckets.iter().map(|b| (b.start, b.len)).collect();
        assert_eq!(spans, vec![(0, 8), (8, 12), (20, 4)]);
        assert_eq!((l.total, l.bucket_of(2)), (24, 1));
    }

    #[test]
    fn expert_buckets_stand_apart_with_their_own_padding() {
        // Parameters 1 and 2 are experts, sharded over 2 ranks; the others over 4.
        let flags = ([false, true, true, false], [false; 4]);
        let l = FlatLayout::grouped(&[5, 3, 7, 2], (&flags.0, &flags.1), 100, [4, 2]);
        let spans: Vec<_> = l
            .buckets
            .iter()
            .map(|b| (b.params.clone(), b.start, b.len, b.expert))
            .collect();
        assert_eq!(
            spans,
            vec![
                (0..1, 0, 8, false),
                (1..3, 8, 10, true),
                (3..4, 18, 4, false)
            ]
        );
        assert_eq!(l.offsets, vec![0, 8, 11, 18]);
    }

    #[test]
    fn one_rank_has_no_padding() {
        let l = FlatLayout::new(&[5, 3, 7], 1 << 20, 1);
        assert_eq!(l.total, 15);
        assert_eq!(l.buckets.len(), 1);
    }
}
