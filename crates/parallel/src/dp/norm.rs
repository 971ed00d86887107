//! The global gradient norm, each element counted once over the whole job.
//!
//! A rank's gradient buffer holds copies that other ranks hold too (replicated parameters on
//! every tensor-parallel rank, the tied output matrix on the last pipeline stage) and, with ZeRO,
//! only its shards. The norm therefore sums squares over the flat ranges a rank owns of the
//! parameters whose copy counts ([`norm_runs`]), then over the groups that split the rest
//! ([`global_sum_squares`]): the tensor-parallel and pipeline groups always, the shard group at
//! ZeRO ≥ 1 (replica groups hold the same shards), and at stage 0 the expert-parallel group for
//! the routed experts, which differ between its ranks.

use std::ops::Range;

use candle_core::{Device, Result, Tensor};

use super::{intersect, FlatLayout, ZeroStage};
use crate::comm::{Comm, Group, ReduceOp};
use crate::mesh::RankGroups;

/// The flat runs to sum squares over: `[others, experts]`, each a list of maximal contiguous
/// ranges within `owned` of the parameters whose copy `counts` (with `split_experts`, routed
/// experts, `expert[i]`, apart from the others). Adjacent ranges are merged: one kernel (and, on
/// a GPU, one read-back) per run instead of one per parameter.
pub fn norm_runs(
    layout: &FlatLayout,
    counts: &[bool],
    expert: &[bool],
    owned: &[Range<usize>],
    split_experts: bool,
) -> [Vec<Range<usize>>; 2] {
    let mut runs: [Vec<Range<usize>>; 2] = [Vec::new(), Vec::new()];
    for i in (0..counts.len()).filter(|&i| counts[i]) {
        let runs = &mut runs[usize::from(split_experts && expert[i])];
        for r in owned {
            let x = intersect(&layout.range(i), r);
            match runs.last_mut() {
                _ if x.is_empty() => {}
                Some(last) if last.end == x.start => last.end = x.end,
                _ => runs.push(x),
            }
        }
    }
    runs
}

/// The job's sum of squares from this rank's `[others, experts]` sums over [`norm_runs`] at
/// ZeRO stage `zero` (every rank calls it alike; the sums run over `g`'s expert-parallel,
/// tensor-parallel, pipeline and shard groups).
pub fn global_sum_squares(
    comm: &dyn Comm,
    g: &RankGroups,
    zero: ZeroStage,
    [others, experts]: [f64; 2],
) -> Result<f64> {
    let sum = |group: &Group, v: f64| -> Result<f64> {
        if group.size() == 1 {
            return Ok(v);
        }
        let t = Tensor::new(&[v], &Device::Cpu)?;
        Ok(comm
            .all_reduce(group, &t, ReduceOp::Sum)?
            .to_vec1::<f64>()?[0])
    };
    let mut sq = others;
    if zero.shards_optimizer() {
        sq += experts;
    } else {
        // Without sharding each expert-parallel rank holds its own experts whole.
        sq += sum(&g.ep, experts)?;
    }
    sq = sum(&g.tp, sq)?;
    sq = sum(&g.pp, sq)?;
    if zero.shards_optimizer() {
        // Shards of one shard group; replica groups hold the same shards. Expert shards are cut
        // over the expert gradient group, whose members, with the other expert-parallel indices,
        // make up the gradient group: each element is still counted once.
        sq = sum(&g.shard, sq)?;
    }
    Ok(sq)
}
