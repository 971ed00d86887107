//! Stragglers: on each logged step every rank's compute time (its forward and backward actions,
//! timed on the device on a GPU) is gathered in the step's one agreement over the job (an
//! all-reduce, `guard.rs`), and a rank
//! slower than `run.straggler_factor` times the median is named in the log and in
//! `metrics.jsonl`.
//!
//! A rank is compared with the ranks of its own pipeline stage only: stages do different work
//! (uneven layouts, zbv's first stage holding both the embedding and the head), so a stage's
//! ranks are its data-, tensor- and context-parallel peers. Waits for peers inside a piece
//! (tensor- and context-parallel collectives) count as compute, so the ranks of one
//! tensor-parallel group look alike: a slow GPU shows against the other data-parallel replicas
//! of its stage (a pipeline-only job has no peers to compare).

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

/// The median of `v` (0 when empty).
fn median(v: &[f64]) -> f64 {
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    }
}

/// The spread of `seconds` (one entry per rank, rank `r` in pipeline stage `stage[r]`) and the
/// ranks above `factor` × the median of their stage.
pub fn spread(seconds: &[f64], stage: &[usize], factor: f64) -> ComputeSpread {
    let stage_median = |st: usize| {
        let peers: Vec<f64> = (0..seconds.len())
            .filter(|&r| stage[r] == st)
            .map(|r| seconds[r])
            .collect();
        median(&peers)
    };
    let mut stragglers: Vec<Straggler> = seconds
        .iter()
        .enumerate()
        .filter_map(|(rank, &s)| {
            let m = stage_median(stage[rank]);
            (m > 0.0 && s > factor * m).then(|| Straggler {
                rank,
                compute_s: s,
                ratio: s / m,
            })
        })
        .collect();
    stragglers.sort_by(|a, b| b.ratio.total_cmp(&a.ratio));
    ComputeSpread {
        compute_median_s: median(seconds),
        compute_max_s: seconds.iter().copied().fold(0.0, f64::max),
        stragglers,
    }
}

impl Trainer {
    /// Whether step `step` is logged (and so measured for stragglers).
    pub(super) fn is_logged(&self, step: usize) -> bool {
        step.is_multiple_of(self.recipe.run.log_interval) || step == self.recipe.train.steps
    }

    /// On a logged step: every rank's compute time of the step just run (`seconds`, by rank,
    /// gathered in the step's agreement) and the stragglers among them.
    pub(super) fn compute_spread(&self, seconds: Option<Vec<f64>>) -> Option<ComputeSpread> {
        let stage = stages(&self.ctx.mesh);
        Some(spread(&seconds?, &stage, self.recipe.run.straggler_factor))
    }
}

/// Each rank's pipeline stage, the group it is compared within.
fn stages(mesh: &parallel::mesh::Mesh) -> Vec<usize> {
    (0..mesh.world_size()).map(|r| mesh.coords(r).pp).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slow_ranks_are_named_slowest_first() {
        let one = [0; 5];
        let s = spread(&[1.0, 1.1, 3.0, 0.9, 1.5], &one, 1.2);
        assert_eq!(s.compute_median_s, 1.1);
        assert_eq!(s.compute_max_s, 3.0);
        let ranks: Vec<usize> = s.stragglers.iter().map(|x| x.rank).collect();
        assert_eq!(ranks, [2, 4]);
        assert!(spread(&[1.0, 1.0, 1.19], &one, 1.2).stragglers.is_empty());
        assert_eq!(spread(&[1.0, 2.0], &one, 1.2).compute_median_s, 1.5);
        assert_eq!(spread(&[1.0, 2.0], &one, 1.2).stragglers[0].rank, 1);
        assert!(spread(&[0.0, 0.0], &one, 1.2).stragglers.is_empty());
    }

    /// Ranks are grouped by their pipeline coordinate: at dp 2 × pp 2 ranks 0 and 1 are stage
    /// 0 (rank = tp + TP·(cp + CP·(dp + DP·pp))), ranks 2 and 3 stage 1.
    #[test]
    fn ranks_are_grouped_by_their_pipeline_stage() {
        let cfg: parallel::ParallelConfig = serde_yaml::from_str("dp: 2\npp: 2\ntp: 2\n").unwrap();
        let mesh = parallel::mesh::Mesh::from_config(&cfg).unwrap();
        assert_eq!(stages(&mesh), [0, 0, 0, 0, 1, 1, 1, 1]);
    }

    /// Stages doing more work (zbv's first holds the embedding and the head) are no
    /// stragglers; a slow rank is found among the replicas of its own stage.
    #[test]
    fn ranks_are_compared_within_their_pipeline_stage() {
        // dp 3 × pp 2, rank r in stage r % 2: stage 0 takes 1.5x stage 1's time.
        let stage = [0, 1, 0, 1, 0, 1];
        let even = spread(&[1.5, 1.0, 1.5, 1.0, 1.5, 1.0], &stage, 1.2);
        assert!(even.stragglers.is_empty());
        let s = spread(&[1.5, 1.0, 1.5, 1.0, 1.5, 1.4], &stage, 1.2);
        let named: Vec<(usize, f64)> = s.stragglers.iter().map(|x| (x.rank, x.ratio)).collect();
        assert_eq!(named, [(5, 1.4)]);
        // One rank per stage: no peers, nobody named.
        assert!(spread(&[3.0, 1.0], &[0, 1], 1.2).stragglers.is_empty());
    }
}
