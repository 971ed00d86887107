//! All-forward-all-backward (GPipe): every stage runs the forwards of all `m` micro-batches,
//! then all `m` backwards. The simplest schedule and the reference the others are compared
//! against: its bubble equals 1F1B's, but every stage keeps all `m` activations alive at once.

use super::schedule::{push_backward, push_forward, Action, ScheduleError, ScheduleKind};

/// Per-stage action lists of GPipe for `pp` stages and `m` micro-batches (`v` must be 1).
pub(crate) fn actions(pp: usize, v: usize, m: usize) -> Result<Vec<Vec<Action>>, ScheduleError> {
    if v != 1 {
        return Err(ScheduleError::VirtualNotSupported {
            kind: ScheduleKind::AllForwardAllBackward,
            v,
        });
    }
    let stages = (0..pp)
        .map(|stage| {
            let at = (pp, v, stage);
            let mut list = Vec::with_capacity(6 * m);
            // Fill: forward every micro-batch in order.
            for micro in 0..m {
                push_forward(&mut list, at, 0, micro);
            }
            // Drain: backward every micro-batch, in the same order (the last stage can start
            // micro-batch 0's backward right after its last forward).
            for micro in 0..m {
                push_backward(&mut list, at, 0, micro);
            }
            list
        })
        .collect();
    Ok(stages)
}
