//! The zbv schedule's order, fitted to what its actions cost. zbv's list scheduler needs the
//! relative costs of a chunk's forward, B and W: found with equal costs it loses most of its
//! advantage when B costs twice W (simulated at pp 4, m 8: bubble 0.33 against 0.10 with the
//! order found for those costs). So the trainer times the actions of its second step (the first
//! warms up allocators and kernels; on a GPU on the device's clock), the ranks' means are
//! combined so that every rank computes the same costs and the same order, and the later steps
//! run that order. The costs go into checkpoints: a resumed run takes the same order. The order
//! changes no gradient beyond rounding: each parameter sums its micro-batches in micro-batch
//! order, but the tied embedding, whose two uses on the first stage may interleave otherwise.

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use parallel::pipeline::{
    build, build_zbv, check_fifo, simulate, validate, zbv, Action, Schedule, ScheduleKind, SimCosts,
};
use parallel::Group;

use super::clock::Timed;
use super::RankCtx;
use crate::recipe::Recipe;

/// Mean seconds of this rank's forward, B and W actions in `timing` (`None` for a kind it ran
/// none of).
pub fn mean_costs(timing: &[Timed]) -> [Option<f64>; 3] {
    let mut sums = [(0.0, 0usize); 3];
    for t in timing {
        let k = match t.action {
            Action::Forward { .. } => 0,
            Action::Backward { .. } => 1,
            Action::Weight { .. } => 2,
            _ => continue,
        };
        sums[k].0 += (t.end - t.start).max(0.0);
        sums[k].1 += 1;
    }
    sums.map(|(s, n)| (n > 0).then(|| s / n as f64))
}

/// Whether a schedule of `kind` is ordered for measured costs.
pub fn tuned(kind: ScheduleKind, pp: usize) -> bool {
    kind == ScheduleKind::ZeroBubbleV && pp > 1
}

/// The mean seconds of a chunk's forward, B and W over every rank's actions in `timing` (each
/// rank's own; W 0 where backwards are not split). Every rank takes part and gets the same
/// numbers: the ranks' means travel by an all-gather (no arithmetic) and each rank averages them
/// in the same order.
pub fn measured(ctx: &RankCtx, timing: &[Timed]) -> Result<SimCosts> {
    let everyone = Group::new((0..ctx.mesh.world_size()).collect());
    let mine: Vec<f64> = mean_costs(timing)
        .iter()
        .map(|c| c.unwrap_or(f64::NAN))
        .collect();
    let t = Tensor::from_vec(mine, (1, 3), &Device::Cpu)?;
    let all = ctx.comm.all_gather(&everyone, &t, 0)?.to_vec2::<f64>()?; // [world, 3]
    let mean = |k: usize| -> f64 {
        let v: Vec<f64> = all.iter().map(|r| r[k]).filter(|x| x.is_finite()).collect();
        v.iter().sum::<f64>() / v.len().max(1) as f64
    };
    Ok(SimCosts {
        forward: mean(0),
        backward: mean(1),
        weight: mean(2),
    })
}

/// The zbv schedule of `recipe` at `current`'s sizes ordered for `costs` (within the caps the
/// planner's memory model sets), checked like every schedule before use.
pub fn ordered(recipe: &Recipe, current: &Schedule, costs: SimCosts) -> Result<Schedule> {
    let caps = crate::plan::memory::zbv_caps(recipe).map_err(|e| anyhow::anyhow!("zbv: {e}"))?;
    let schedule = build_zbv(current.pp, current.m, &zbv::Fit { costs, caps })?;
    validate(&schedule)?;
    check_fifo(&schedule)?;
    Ok(schedule)
}

/// The bubble fraction 1F1B has on `pp` stages of `m` micro-batches where each stage's two
/// chunks cost `chunk` each (zbv's measured costs): the schedule zbv must not lose to.
pub fn one_f_one_b_bubble(pp: usize, m: usize, chunk: SimCosts) -> Result<f64> {
    let stage = SimCosts {
        forward: 2.0 * chunk.forward,
        backward: 2.0 * (chunk.backward + chunk.weight),
        weight: 0.0,
    };
    simulated_bubble(&build(ScheduleKind::OneFOneB, pp, 1, m)?, stage)
}

/// The bubble fraction `schedule` has in the simulator on `costs`.
pub fn simulated_bubble(schedule: &Schedule, costs: SimCosts) -> Result<f64> {
    Ok(simulate(schedule, costs)
        .context("simulating a schedule on its measured costs")?
        .bubble_fraction)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn means_per_kind_of_action() {
        let t = |action, start, end| Timed { action, start, end };
        let (f, b) = (
            Action::Forward { chunk: 0, micro: 0 },
            Action::Backward { chunk: 1, micro: 0 },
        );
        let send = Action::SendGrad {
            chunk: 1,
            micro: 0,
            to: 1,
        };
        let timing = [
            t(f, 0.0, 1.0),
            t(f, 1.0, 4.0),
            t(b, 4.0, 6.0),
            t(send, 6.0, 9.0),
        ];
        assert_eq!(mean_costs(&timing), [Some(2.0), Some(2.0), None]);
    }
}
