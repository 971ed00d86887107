//! ZB-H1, the zero-bubble schedule of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024),
//! with 1F1B's peak activation memory: each backward is split into B (the input gradient, on
//! the critical path between stages) and W (the weight gradients, needed only by the optimizer),
//! and W actions fill the idle time 1F1B leaves in its cool-down.
//!
//! Stage `s` runs 1F1B's order of forwards and B actions and puts the W of micro-batch `k − s`
//! right after the B of micro-batch `k`: stage 0 pairs each B with its W, and a later stage,
//! which 1F1B leaves with `pp − s` micro-batches in flight, carries `s` W actions more, up to
//! the first stage's `pp`, and runs them after its last B, while the last gradients travel to
//! stage 0. A micro-batch holds its activations from its forward to its W (after its B, the
//! factors of its weight gradients). When a stage's micro-batches hold more than the first
//! stage's (the head's logits on the last stage), it may defer fewer
//! ([`actions_deferring`]; the trainer asks the planner's memory model how many fit).
//!
//! # Closed form (checked by `tests/pipeline_schedules.rs`)
//!
//! With forward, B and W costing `f`, `b` and `w` per micro-batch, `w ≤ b`, and `m ≥ pp`:
//! `makespan = m (f + b + w) + (pp − 1)(f + b − w)`, against 1F1B's
//! `m (f + b + w) + (pp − 1)(f + b + w)`: with the three equal, a third of 1F1B's bubble.

use super::one_f_one_b::warmup_forwards;
use super::schedule::{push_backward, push_forward, Action, ScheduleError, ScheduleKind};

/// Per-stage action lists of ZB-H1 for `pp` stages and `m` micro-batches (`v` must be 1).
pub(crate) fn actions(pp: usize, v: usize, m: usize) -> Result<Vec<Vec<Action>>, ScheduleError> {
    if v != 1 {
        return Err(ScheduleError::VirtualNotSupported {
            kind: ScheduleKind::ZeroBubbleH1,
            v,
        });
    }
    let delays: Vec<usize> = (0..pp).map(|s| deferred_weights(s, m)).collect();
    actions_deferring(pp, m, &delays)
}

/// [`actions`] with stage `s` deferring `deferred[s]` weight actions (at most `m`) instead of
/// `s`: fewer keep a stage's activations lower at the cost of idle time in its cool-down.
pub(crate) fn actions_deferring(
    pp: usize,
    m: usize,
    deferred: &[usize],
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    if deferred.len() != pp {
        return Err(ScheduleError::Deferrals {
            pp,
            got: deferred.len(),
        });
    }
    Ok((0..pp)
        .map(|stage| stage_actions(pp, stage, m, deferred[stage]))
        .collect())
}

/// The W actions stage `stage` defers by default: the paper's `stage` (at most `m`).
pub fn deferred_weights(stage: usize, m: usize) -> usize {
    stage.min(m)
}

/// The action list of stage `stage`, its W actions `delay` B actions late (at most `m`).
pub fn stage_actions(pp: usize, stage: usize, m: usize, delay: usize) -> Vec<Action> {
    let at = (pp, 1, stage);
    let warmup = warmup_forwards(pp, stage, m);
    let delay = delay.min(m);
    let mut list = Vec::with_capacity(7 * m);
    let weight = |list: &mut Vec<Action>, micro| list.push(Action::Weight { chunk: 0, micro });
    for micro in 0..warmup {
        push_forward(&mut list, at, 0, micro);
    }
    for k in 0..m {
        if warmup + k < m {
            push_forward(&mut list, at, 0, warmup + k);
        }
        push_backward(&mut list, at, 0, k);
        if k >= delay {
            weight(&mut list, k - delay);
        }
    }
    for micro in m - delay..m {
        weight(&mut list, micro);
    }
    list
}
