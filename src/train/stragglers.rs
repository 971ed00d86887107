//! Stragglers: on each logged step every rank's compute time (its forward and backward actions,
//! timed on the device on a GPU) is gathered with one small all-reduce over the job, and a rank
//! slower than `run.straggler_factor` times the median is named in the log and in
//! `metrics.jsonl`.
//!
//! Waits for peers inside a piece (tensor- and context-parallel collectives) count as compute,
//! so the ranks of one tensor-parallel group look alike: a slow GPU shows against the other
//! data-parallel replicas and pipeline stages.

use anyhow::Result;
use candle_core::{Device, Tensor};
use parallel::ReduceOp;
use serde::Serialize;

use super::clock::Timed;
use super::Trainer;

/// One rank named as a straggler.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Straggler {
    /// Global rank.
    pub rank: usize,
    /// Its compute seconds in the step.
    pub compute_s: f64,
    /// Its compute time over the median.
    pub ratio: f64,
}

/// What a logged step measured of every rank's compute.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ComputeSpread {
    /// The median over the ranks of the step's compute seconds.
    pub compute_median_s: f64,
    /// The slowest rank's compute seconds.
    pub compute_max_s: f64,
    /// The ranks slower than `run.straggler_factor` times the median, slowest first.
    pub stragglers: Vec<Straggler>,
}

/// Seconds of compute actions (forward, backward, weight) in `timing`.
pub fn compute_seconds(timing: &[Timed]) -> f64 {
    timing
        .iter()
        .filter(|t| t.action.is_compute())
        .map(|t| (t.end - t.start).max(0.0))
        .sum()
}

/// The spread of `seconds` (one entry per rank) and the ranks above `factor` × the median.
pub fn spread(seconds: &[f64], factor: f64) -> ComputeSpread {
    let mut sorted = seconds.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median = match n {
        0 => 0.0,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    };
    let mut stragglers: Vec<Straggler> = seconds
        .iter()
        .enumerate()
        .filter(|&(_, &s)| median > 0.0 && s > factor * median)
        .map(|(rank, &s)| Straggler {
            rank,
            compute_s: s,
            ratio: s / median,
        })
        .collect();
    stragglers.sort_by(|a, b| b.ratio.total_cmp(&a.ratio));
    ComputeSpread {
        compute_median_s: median,
        compute_max_s: sorted.last().copied().unwrap_or(0.0),
        stragglers,
    }
}

impl Trainer {
    /// Whether step `step` is logged (and so measured for stragglers).
    pub(super) fn is_logged(&self, step: usize) -> bool {
        step.is_multiple_of(self.recipe.run.log_interval) || step == self.recipe.train.steps
    }

    /// On a logged step: every rank's compute time of the step just run, gathered, and the
    /// stragglers among them. Every rank calls it at the same steps.
    pub(super) fn compute_spread(&self, step: usize) -> Result<Option<ComputeSpread>> {
        if !self.is_logged(step) {
            return Ok(None);
        }
        let world = self.ctx.mesh.world_size();
        let mut v = vec![0f64; world];
        v[self.ctx.rank] = compute_seconds(&self.timing);
        if world > 1 {
            let t = Tensor::from_vec(v, world, &Device::Cpu)?;
            v = self
                .ctx
                .comm
                .all_reduce(&self.world_group(), &t, ReduceOp::Sum)?
                .to_vec1::<f64>()?;
        }
        Ok(Some(spread(&v, self.recipe.run.straggler_factor)))
    }
}

/// Tests: `PRETRAIN_TEST_SLOW_RANK=R:MS` makes rank `R` pause `MS` milliseconds in each of its
/// forward actions (on the CPU, where actions are timed on the host clock).
pub(super) fn test_slowdown(rank: usize) -> Option<std::time::Duration> {
    let spec = std::env::var("PRETRAIN_TEST_SLOW_RANK").ok()?;
    let (r, ms) = spec.split_once(':')?;
    (r.parse::<usize>().ok()? == rank)
        .then(|| std::time::Duration::from_millis(ms.parse().unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slow_ranks_are_named_slowest_first() {
        let s = spread(&[1.0, 1.1, 3.0, 0.9, 1.5], 1.2);
        assert_eq!(s.compute_median_s, 1.1);
        assert_eq!(s.compute_max_s, 3.0);
        let ranks: Vec<usize> = s.stragglers.iter().map(|x| x.rank).collect();
        assert_eq!(ranks, [2, 4]);
        assert!(spread(&[1.0, 1.0, 1.19], 1.2).stragglers.is_empty());
        assert_eq!(spread(&[1.0, 2.0], 1.2).compute_median_s, 1.5);
        assert_eq!(spread(&[1.0, 2.0], 1.2).stragglers[0].rank, 1);
        assert!(spread(&[0.0, 0.0], 1.2).stragglers.is_empty());
    }
}
