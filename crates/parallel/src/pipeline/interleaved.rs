//! Megatron's interleaved 1F1B schedule (virtual pipeline, Narayanan et al. 2021): each stage
//! holds `v` model chunks and walks micro-batches in groups of `pp`, switching chunk after every
//! group. This divides the pipeline bubble by `v` at the cost of `v` times more messages.
//!
//! Ordering (the facts of Megatron's `forward_backward_pipelining_with_interleaving`), with
//! `k` the index of a stage's `k`-th forward (or backward) among its `m * v`:
//!
//! - forward `k` runs local chunk `(k / pp) % v` on micro-batch `(k / (pp * v)) * pp + k % pp`;
//! - backward `k` runs the same micro-batch on local chunk `v - 1 - (k / pp) % v` (gradients
//!   enter through the last chunk);
//! - stage `s` runs `(pp - s - 1) * 2 + (v - 1) * pp` warm-up forwards, capped at `m * v`, and
//!   all `m * v` forwards up front when `m == pp`.

use super::schedule::{push_backward, push_forward, Action, ScheduleError};

/// Number of warm-up forwards of stage `stage` (Megatron's interleaved warm-up count).
///
/// `m * v` (everything is warm-up) when `m == pp`, otherwise
/// `min((pp - stage - 1) * 2 + (v - 1) * pp, m * v)`.
pub fn warmup_forwards(pp: usize, v: usize, m: usize, stage: usize) -> usize {
    let total = m.saturating_mul(v);
    if m == pp {
        return total;
    }
    let warmup = pp
        .saturating_sub(stage + 1)
        .saturating_mul(2)
        .saturating_add(v.saturating_sub(1).saturating_mul(pp));
    warmup.min(total)
}

/// `(local chunk, micro-batch)` of a stage's `k`-th forward (`forward = true`) or backward.
pub fn chunk_and_micro(pp: usize, v: usize, k: usize, forward: bool) -> (usize, usize) {
    let in_group = k % (pp * v);
    let chunk = in_group / pp;
    let chunk = if forward { chunk } else { v - 1 - chunk };
    let micro = (k / (pp * v)) * pp + k % pp;
    (chunk, micro)
}

/// Per-stage action lists of interleaved 1F1B (`m` must be a multiple of `pp`, and `v > 1`
/// needs `pp >= 2`). With `v = 1` this is a valid 1F1B variant with Megatron's doubled warm-up.
pub(crate) fn actions(pp: usize, v: usize, m: usize) -> Result<Vec<Vec<Action>>, ScheduleError> {
    if v > 1 && pp < 2 {
        return Err(ScheduleError::VirtualNeedsPipeline { v, pp });
    }
    if !m.is_multiple_of(pp) {
        return Err(ScheduleError::MicroBatchesNotMultipleOfPp { m, pp });
    }
    Ok((0..pp)
        .map(|stage| stage_actions(pp, v, m, stage))
        .collect())
}

/// The action list of one stage.
fn stage_actions(pp: usize, v: usize, m: usize, stage: usize) -> Vec<Action> {
    let at = (pp, v, stage);
    let total = m * v;
    let warmup = warmup_forwards(pp, v, m, stage);
    let steady = total - warmup;
    let mut list = Vec::with_capacity(6 * total);
    let forward = |list: &mut Vec<Action>, k: usize| {
        let (chunk, micro) = chunk_and_micro(pp, v, k, true);
        push_forward(list, at, chunk, micro);
    };
    let backward = |list: &mut Vec<Action>, k: usize| {
        let (chunk, micro) = chunk_and_micro(pp, v, k, false);
        push_backward(list, at, chunk, micro);
    };

    // Warm-up: forwards only. Besides the `pp - s - 1` hops of plain 1F1B (doubled, as every
    // stage also waits for the wrap-around from the last stage), every chunk but the last needs a
    // full group of `pp` micro-batches in flight before the last chunk's first gradient exists.
    for k in 0..warmup {
        forward(&mut list, k);
    }

    // Steady state: forward `warmup + k`, then backward `k`; live activations stay at
    // `warmup + 1`.
    for k in 0..steady {
        forward(&mut list, warmup + k);
        backward(&mut list, k);
    }

    // Cool-down: the backwards still owed for the warm-up forwards.
    for k in steady..total {
        backward(&mut list, k);
    }
    list
}
