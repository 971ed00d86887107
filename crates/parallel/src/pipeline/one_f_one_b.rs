//! Megatron's non-interleaved 1F1B schedule (PipeDream-Flush): a warm-up of forwards, a steady
//! state alternating one forward and one backward, and a cool-down of the remaining backwards.
//! It has the same bubble as GPipe but bounds the live activations of stage `s` by
//! `min(pp - s, m)` instead of `m`.

use super::schedule::{push_backward, push_forward, Action, ScheduleError, ScheduleKind};

/// Number of warm-up forwards stage `stage` runs before its first backward:
/// `min(pp - stage - 1, m)` (the later the stage, the sooner its first gradient arrives).
pub fn warmup_forwards(pp: usize, stage: usize, m: usize) -> usize {
    pp.saturating_sub(stage + 1).min(m)
}

/// Per-stage action lists of 1F1B for `pp` stages and `m` micro-batches (`v` must be 1).
pub(crate) fn actions(pp: usize, v: usize, m: usize) -> Result<Vec<Vec<Action>>, ScheduleError> {
    if v != 1 {
        return Err(ScheduleError::VirtualNotSupported {
            kind: ScheduleKind::OneFOneB,
            v,
        });
    }
    Ok((0..pp).map(|stage| stage_actions(pp, stage, m)).collect())
}

/// The action list of one stage.
fn stage_actions(pp: usize, stage: usize, m: usize) -> Vec<Action> {
    let at = (pp, 1, stage);
    let warmup = warmup_forwards(pp, stage, m);
    let steady = m - warmup;
    let mut list = Vec::with_capacity(6 * m);

    // Warm-up: forwards only, filling the pipeline until the first gradient can come back.
    // Stage s must have `pp - s - 1` micro-batches in flight downstream before micro-batch 0's
    // gradient returns.
    for micro in 0..warmup {
        push_forward(&mut list, at, 0, micro);
    }

    // Steady state: one forward (of micro-batch `warmup + i`), then one backward (of the oldest
    // in-flight micro-batch `i`). Live activations stay at `warmup + 1`.
    for i in 0..steady {
        push_forward(&mut list, at, 0, warmup + i);
        push_backward(&mut list, at, 0, i);
    }

    // Cool-down: the backwards of the `warmup` micro-batches still in flight, oldest first.
    for micro in steady..m {
        push_backward(&mut list, at, 0, micro);
    }
    list
}
