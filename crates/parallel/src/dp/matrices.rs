//! Whole matrices for an optimizer that transforms each logical matrix as one (Muon's
//! orthogonalisation), whatever shards it: [`WholeMatrices::map`] takes a value per element
//! this rank owns (in the order of its owned flat ranges) and gives back `f` of each whole
//! matrix, cut to the same elements.
//!
//! A matrix is cut twice: by tensor parallelism into blocks along one dimension (its layout
//! is the same flat layout on every tensor-parallel rank), and by ZeRO into flat shards of
//! each bucket over the shard group (routed experts' buckets: the expert gradient group). Each
//! matrix has one owner in its shard group, chosen so the owners' work is balanced
//! ([`assign_owners`], longest job first by the cost of `f`). In three phases:
//!
//! 1. bucket by bucket, the shard group all-gathers the bucket's values (skipped without
//!    sharding), so every member holds its tensor-parallel block of each matrix in the bucket,
//!    and each owner all-gathers its matrices' blocks over the tensor-parallel group (members
//!    of one tensor-parallel group are at the same shard index, so own the same matrices);
//! 2. `f` gets all of an owner's whole matrices at once (so an optimizer can batch those of one
//!    shape); a matrix tensor parallelism cuts is iterated by one of the owner's peers (the
//!    peers' work balanced as the owners' is) and broadcast to the others, and each keeps its
//!    own block of each result;
//! 3. bucket by bucket, each owner broadcasts its results to the shard group, and every member
//!    keeps the part of the bucket it owns.
//!
//! Without sharding (ZeRO stage 0) every rank holds every matrix, and the work is still spread
//! ([`Spread::Replicated`]): over the gradient group, each owner transforms its matrices and
//! broadcasts the results (step 1 is not needed), so `f`'s cost divides by the group's size as
//! it does with sharding; the results are those each rank would compute itself, as every rank
//! holds the same values. A rank alone ([`Spread::Alone`]) applies `f` to every matrix.
//! Memory: the whole matrices an owner transforms (its share of them), their results, and a
//! bucket's values at a time besides the output. Traffic per member and step,
//! sharded: the bucket once in (step 1) and once out (step 3), about twice ZeRO's parameter
//! all-gather in f32; replicated, once out.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use super::{FlatLayout, ShardPos};
use crate::comm::{Comm, Group};

/// One matrix a rank holds: its parameter, the shape of its block here, and the dimension
/// tensor parallelism cuts it along (`None`: held whole).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matrix {
    /// Index of the parameter in the flat layout.
    pub param: usize,
    /// Shape of the block this rank holds `[rows, cols]`.
    pub shape: [usize; 2],
    /// The dimension tensor-parallel ranks cut it along.
    pub tp_dim: Option<usize>,
    /// A routed expert's (sharded over the expert gradient group).
    pub expert: bool,
}

impl Matrix {
    /// The shape of the whole matrix over `tp` tensor-parallel ranks.
    pub fn whole_shape(&self, tp: usize) -> [usize; 2] {
        let mut s = self.shape;
        if let Some(d) = self.tp_dim {
            s[d] *= tp;
        }
        s
    }
}

/// How the matrices' optimizer state lies over the shard groups of [`MatrixGroups`], and so who
/// transforms each matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spread {
    /// This rank transforms every matrix it holds (no group to share the work with).
    Alone,
    /// Every member holds every matrix (ZeRO stage 0); each matrix is transformed by its owner
    /// and broadcast to the others.
    Replicated,
    /// Each member holds its shard of every bucket (ZeRO stage 1 and above); the buckets are
    /// gathered, each matrix transformed by its owner and broadcast.
    Sharded,
}

/// The groups the matrices are spread over.
#[derive(Debug, Clone)]
pub struct MatrixGroups {
    /// The group the dense buckets' matrices are spread over: the ZeRO shard group when the
    /// state is sharded, else the gradient group.
    pub shard: Group,
    /// The expert gradient group, over which the routed experts' buckets are spread.
    pub expert_grad: Group,
    /// Tensor-parallel group.
    pub tp: Group,
}

/// Owners (shard indices) of jobs of cost `cost[i]` in a group of `size` members: the longest
/// job first to the least-loaded member (ties: the lower index), which keeps the largest load
/// within 4/3 of the best possible (Graham's bound).
pub fn assign_owners(cost: &[f64], size: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..cost.len()).collect();
    order.sort_by(|&a, &b| cost[b].total_cmp(&cost[a]).then(a.cmp(&b)));
    let mut load = vec![0f64; size.max(1)];
    let mut owner = vec![0; cost.len()];
    for i in order {
        let (least, _) = load
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(b.1).then(a.0.cmp(&b.0)))
            .expect("a group has a member");
        owner[i] = least;
        load[least] += cost[i];
    }
    owner
}

/// The matrices of a rank, where they are and who transforms them.
pub struct WholeMatrices {
    comm: Arc<dyn Comm>,
    layout: FlatLayout,
    spread: Spread,
    pos: ShardPos,
    groups: MatrixGroups,
    matrices: Vec<Matrix>,
    /// Owner (shard index) of each matrix.
    owner: Vec<usize>,
    /// Of a matrix tensor parallelism cuts, the peer (index in the tensor-parallel group) that
    /// iterates it for its owner's peers.
    tp_owner: Vec<usize>,
    /// The matrices of each bucket, in flat order.
    by_bucket: Vec<Vec<usize>>,
}

impl WholeMatrices {
    /// `matrices` of a rank at `pos` in its shard groups whose state is laid out by `layout`
    /// and lies over the groups as `spread` says; `cost` gives the work of transforming a whole
    /// matrix of a shape.
    pub fn new(
        comm: Arc<dyn Comm>,
        layout: FlatLayout,
        (spread, pos): (Spread, ShardPos),
        groups: MatrixGroups,
        matrices: Vec<Matrix>,
        cost: impl Fn([usize; 2]) -> f64,
    ) -> Self {
        let tp = groups.tp.size();
        let mut owner = vec![0; matrices.len()];
        for expert in [false, true] {
            let ix: Vec<usize> = (0..matrices.len())
                .filter(|&i| matrices[i].expert == expert)
                .collect();
            let costs: Vec<f64> = ix
                .iter()
                .map(|&i| cost(matrices[i].whole_shape(tp)))
                .collect();
            let size = if expert { pos.expert.1 } else { pos.dense.1 };
            for (&i, o) in ix.iter().zip(assign_owners(&costs, size)) {
                owner[i] = o;
            }
        }
        // An owner's matrices that tensor parallelism cuts are spread over its peers, balanced
        // alike.
        let mut tp_owner = vec![0; matrices.len()];
        let cut = |i: usize| tp > 1 && matrices[i].tp_dim.is_some();
        let mut groups_of: std::collections::BTreeMap<(bool, usize), Vec<usize>> =
            Default::default();
        for i in (0..matrices.len()).filter(|&i| cut(i)) {
            groups_of
                .entry((matrices[i].expert, owner[i]))
                .or_default()
                .push(i);
        }
        for ix in groups_of.values() {
            let costs: Vec<f64> = ix
                .iter()
                .map(|&i| cost(matrices[i].whole_shape(tp)))
                .collect();
            for (&i, o) in ix.iter().zip(assign_owners(&costs, tp)) {
                tp_owner[i] = o;
            }
        }
        let mut by_bucket = vec![Vec::new(); layout.buckets.len()];
        for (m, mat) in matrices.iter().enumerate() {
            by_bucket[layout.bucket_of(mat.param)].push(m);
        }
        for b in &mut by_bucket {
            b.sort_by_key(|&m| layout.offsets[matrices[m].param]);
        }
        Self {
            comm,
            layout,
            spread,
            pos,
            groups,
            matrices,
            owner,
            tp_owner,
            by_bucket,
        }
    }

    /// Whether tensor parallelism cuts matrix `m`.
    fn tp_cut(&self, m: usize) -> bool {
        self.groups.tp.size() > 1 && self.matrices[m].tp_dim.is_some()
    }

    /// Whether this rank iterates matrix `m` itself: it transforms `m` and, when tensor
    /// parallelism cuts `m`, is the peer that iterates it for the others.
    fn iterates(&self, m: usize) -> bool {
        let tp = &self.groups.tp;
        let here = tp.index_of(self.comm.rank()).unwrap_or(0);
        self.transforms(m) && (!self.tp_cut(m) || self.tp_owner[m] == here)
    }

    /// Whether this rank transforms matrix `m` (of [`WholeMatrices::matrices`]).
    fn transforms(&self, m: usize) -> bool {
        let (index, size) = self.shard_pos(self.matrices[m].expert);
        self.spread == Spread::Alone || size == 1 || self.owner[m] == index
    }

    /// `(index, size)` in the shard group of dense or expert buckets.
    fn shard_pos(&self, expert: bool) -> (usize, usize) {
        if expert {
            self.pos.expert
        } else {
            self.pos.dense
        }
    }

    /// The matrices, in the order given.
    pub fn matrices(&self) -> &[Matrix] {
        &self.matrices
    }

    /// The shapes of the whole matrices this rank transforms each step.
    pub fn transformed_shapes(&self) -> Vec<[usize; 2]> {
        let tp = self.groups.tp.size();
        (0..self.matrices.len())
            .filter(|&m| self.transforms(m))
            .map(|m| self.matrices[m].whole_shape(tp))
            .collect()
    }

    /// This rank's range of bucket `b` (its shard, or the whole bucket without sharding).
    fn own_range(&self, b: usize) -> Range<usize> {
        let bucket = &self.layout.buckets[b];
        if self.spread == Spread::Sharded {
            self.pos.shard(bucket)
        } else {
            bucket.start..bucket.start + bucket.len
        }
    }

    /// `f` of every whole matrix, cut to this rank's elements: `u` holds a value for every
    /// element this rank owns (its owned flat ranges back to back, f32); the result has the
    /// same layout, zero outside the matrices. `f` gets every matrix this rank transforms at
    /// once, whole, and returns their results in that order (an optimizer batches those of one
    /// shape). Every member of the shard groups and of the tensor-parallel group calls it
    /// together.
    pub fn map(
        &self,
        u: &Tensor,
        f: &mut dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
    ) -> Result<Tensor> {
        let device = u.device();
        let zeros = |n: usize| Tensor::zeros(n, DType::F32, device);
        // 1. The matrices this rank transforms, whole, bucket by bucket.
        let (mut inputs, mut which) = (Vec::new(), Vec::new());
        let mut at = 0;
        for (b, mats) in self.by_bucket.iter().enumerate() {
            let n = self.own_range(b).len();
            if n == 0 || mats.is_empty() {
                at += n; // an empty bucket (on every rank), or one without matrices
                continue;
            }
            let bucket = &self.layout.buckets[b];
            let gathered = self.spread == Spread::Sharded && self.group(b).size() > 1;
            let mine = u.narrow(0, at, n)?;
            let whole = if gathered {
                self.comm.all_gather(self.group(b), &mine, 0)? // [bucket.len]
            } else {
                mine
            };
            for (k, &m) in mats.iter().enumerate() {
                if self.transforms(m) {
                    // A copy of its own when it lies in a gathered bucket, which is freed.
                    let input = self.assemble(m, &whole, bucket.start, gathered)?;
                    if self.iterates(m) {
                        inputs.push(input);
                        which.push((b, k));
                    }
                }
            }
            at += n;
        }
        if at != u.elem_count() {
            candle_core::bail!(
                "whole matrices: {} owned values given, the layout owns {at}",
                u.elem_count()
            );
        }
        // 2. `f` of them all.
        let outputs = if inputs.is_empty() {
            Vec::new()
        } else {
            f(&inputs)?
        };
        if outputs.len() != inputs.len() {
            candle_core::bail!(
                "whole matrices: {} results for {} matrices",
                outputs.len(),
                inputs.len()
            );
        }
        drop(inputs);
        let mut results: Vec<Vec<Option<Tensor>>> =
            self.by_bucket.iter().map(|m| vec![None; m.len()]).collect();
        for ((b, k), o) in which.into_iter().zip(outputs) {
            results[b][k] = Some(o);
        }
        // The results of matrices tensor parallelism cuts, from the peer that iterated each to
        // the others; every transformed matrix cut back to this rank's block.
        for (b, mats) in self.by_bucket.iter().enumerate() {
            for (k, &m) in mats.iter().enumerate() {
                if !self.transforms(m) {
                    continue;
                }
                if self.tp_cut(m) {
                    let tp = &self.groups.tp;
                    let [rows, cols] = self.matrices[m].whole_shape(tp.size());
                    let sent = match results[b][k].take() {
                        Some(o) => o,
                        None => Tensor::zeros((rows, cols), DType::F32, device)?,
                    };
                    let root = tp.ranks()[self.tp_owner[m]];
                    results[b][k] = Some(self.comm.broadcast(tp, &sent, root)?);
                }
                let whole = results[b][k].take().ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "whole matrices: no result for parameter {}",
                        self.matrices[m].param
                    ))
                })?;
                results[b][k] = Some(self.cut(m, &whole)?);
            }
        }
        // 3. Bucket by bucket: the owners' results shared, this rank's part kept.
        let mut out = Vec::with_capacity(self.layout.buckets.len());
        for (b, mats) in self.by_bucket.iter().enumerate() {
            let own = self.own_range(b);
            let n = own.len();
            if n == 0 {
                continue;
            }
            if mats.is_empty() {
                out.push(zeros(n)?);
                continue;
            }
            let bucket = &self.layout.buckets[b];
            if self.spread != Spread::Alone && self.group(b).size() > 1 {
                self.share(mats, &mut results[b], self.group(b), device)?;
            }
            // The bucket's results in flat order, then this rank's part of them.
            let mut parts = Vec::with_capacity(2 * mats.len() + 1);
            let mut pos = bucket.start;
            for (k, &m) in mats.iter().enumerate() {
                let r = self.layout.range(self.matrices[m].param);
                if r.start > pos {
                    parts.push(zeros(r.start - pos)?);
                }
                let result = results[b][k].take().ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "whole matrices: no result for parameter {} (owner {})",
                        self.matrices[m].param, self.owner[m]
                    ))
                })?;
                parts.push(result);
                pos = r.end;
            }
            if bucket.start + bucket.len > pos {
                parts.push(zeros(bucket.start + bucket.len - pos)?);
            }
            let o = Tensor::cat(&parts, 0)?; // [bucket.len]

            // Its own storage: a view would keep the whole bucket alive until the end.
            out.push(
                o.narrow(0, own.start - bucket.start, n)?
                    .force_contiguous()?,
            );
        }
        if out.is_empty() {
            return zeros(0);
        }
        Tensor::cat(&out, 0)
    }

    /// The group bucket `b` is sharded (or its work spread) over.
    fn group(&self, b: usize) -> &Group {
        if self.layout.buckets[b].expert {
            &self.groups.expert_grad
        } else {
            &self.groups.shard
        }
    }

    /// Matrix `m` whole, from its block here in `whole` (a bucket's values from flat element
    /// `start`): the tensor-parallel group's blocks all-gathered, or the block itself (a copy of
    /// its own when `copy`).
    fn assemble(&self, m: usize, whole: &Tensor, start: usize, copy: bool) -> Result<Tensor> {
        let mat = self.matrices[m];
        let r = self.layout.range(mat.param);
        let block = whole
            .narrow(0, r.start - start, r.len())?
            .reshape((mat.shape[0], mat.shape[1]))?; // [rows, cols]
        let tp = &self.groups.tp;
        match mat.tp_dim {
            Some(d) if tp.size() > 1 => Ok(self.comm.all_gather(tp, &block, d)?), // the whole matrix
            _ if copy => block.force_contiguous(),
            _ => Ok(block),
        }
    }

    /// The result `o` of matrix `m` cut back to this rank's tensor-parallel block, flat.
    fn cut(&self, m: usize, o: &Tensor) -> Result<Tensor> {
        let mat = self.matrices[m];
        let tp = &self.groups.tp;
        let o = match mat.tp_dim {
            Some(d) if tp.size() > 1 => {
                let i = tp.index_of(self.comm.rank()).unwrap_or(0);
                o.narrow(d, i * mat.shape[d], mat.shape[d])?
            }
            _ => o.clone(),
        };
        o.flatten_all()?.contiguous()
    }

    /// Each owner's results in `results` (this rank's own are present) broadcast to the shard
    /// `group`, one message per owner holding all of its matrices of the bucket.
    fn share(
        &self,
        mats: &[usize],
        results: &mut [Option<Tensor>],
        group: &Group,
        device: &candle_core::Device,
    ) -> Result<()> {
        for owner in 0..group.size() {
            let theirs: Vec<usize> = (0..mats.len())
                .filter(|&k| self.owner[mats[k]] == owner)
                .collect();
            if theirs.is_empty() {
                continue;
            }
            let lens: Vec<usize> = theirs
                .iter()
                .map(|&k| self.layout.numels[self.matrices[mats[k]].param])
                .collect();
            let total: usize = lens.iter().sum();
            let sent = if self.results_here(&theirs, results) {
                let own: Vec<Tensor> = theirs.iter().filter_map(|&k| results[k].clone()).collect();
                Tensor::cat(&own, 0)?
            } else {
                Tensor::zeros(total, DType::F32, device)?
            };
            let got = self.comm.broadcast(group, &sent, group.ranks()[owner])?;
            let mut at = 0;
            for (&k, &len) in theirs.iter().zip(&lens) {
                results[k] = Some(got.narrow(0, at, len)?);
                at += len;
            }
        }
        Ok(())
    }

    /// Whether every one of `theirs` has its result here.
    fn results_here(&self, theirs: &[usize], results: &[Option<Tensor>]) -> bool {
        theirs.iter().all(|&k| results[k].is_some())
    }
}

#[cfg(test)]
mod tests;
