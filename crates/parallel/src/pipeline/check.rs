//! Static checks of a [`Schedule`]: [`validate`], the structural checks the simulator runs before
//! executing, and [`check_fifo`], the executor's extra requirement that every channel between two
//! stages receives its messages in the order they are sent. Also defines the message keys that
//! pair sends with receives.

use std::collections::HashMap;

use super::schedule::{Action, Schedule};
use super::sim::SimError;

/// What travels between stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Payload {
    Activation,
    Grad,
}

/// A message, named by payload, the global chunk that consumes it, and the micro-batch.
pub(crate) type Key = (Payload, usize, usize);

/// Checks `sched` without executing it: sizes, indices in range, exactly one forward and one
/// backward per (chunk, micro) on every stage (and exactly one weight action when the schedule
/// splits its backwards, none otherwise), and every message routed between the stages holding
/// neighbouring global chunks with exactly one send and one receive.
pub fn validate(sched: &Schedule) -> Result<(), SimError> {
    let (pp, v, m) = (sched.pp, sched.v, sched.m);
    let total = pp.checked_mul(v).and_then(|x| x.checked_mul(m));
    if pp == 0 || v == 0 || m == 0 || total.is_none() {
        return Err(SimError::BadSizes { pp, v, m });
    }
    if sched.actions.len() != pp {
        return Err(SimError::StageCount {
            pp,
            got: sched.actions.len(),
        });
    }
    // Message key -> (sends, receives), each as (stage, action) in schedule order.
    type Ends = (Vec<(usize, Action)>, Vec<(usize, Action)>);
    let mut messages: HashMap<Key, Ends> = HashMap::new();
    let mut order: Vec<Key> = Vec::new();
    let split = sched.splits_backward();
    for (stage, list) in sched.actions.iter().enumerate() {
        // (chunk, micro) -> (forwards, backwards, weights); a map, so huge `m` costs nothing.
        let mut counts: HashMap<(usize, usize), (usize, usize, usize)> = HashMap::new();
        for (index, &action) in list.iter().enumerate() {
            let (chunk, micro) = (action.chunk(), action.micro());
            let peer = match action {
                Action::SendActivation { to, .. } | Action::SendGrad { to, .. } => Some(to),
                Action::RecvActivation { from, .. } | Action::RecvGrad { from, .. } => Some(from),
                _ => None,
            };
            if chunk >= v || micro >= m || peer.is_some_and(|p| p >= pp) {
                return Err(SimError::OutOfRange {
                    stage,
                    index,
                    action,
                    pp,
                    v,
                    m,
                });
            }
            let count = counts.entry((chunk, micro)).or_default();
            let seen = match action {
                Action::Forward { .. } => &mut count.0,
                Action::Backward { .. } => &mut count.1,
                Action::Weight { .. } => &mut count.2,
                _ => {
                    let (key, is_send) = route(sched, stage, index, action)?;
                    let ends = messages.entry(key).or_insert_with(|| {
                        order.push(key);
                        (Vec::new(), Vec::new())
                    });
                    let side = if is_send { &mut ends.0 } else { &mut ends.1 };
                    side.push((stage, action));
                    continue;
                }
            };
            *seen += 1;
            if *seen > 1 {
                return Err(SimError::DuplicateCompute { stage, action });
            }
        }
        // The first (chunk, micro) without both computes; stops after at most
        // `counts.len() + 1` steps.
        for chunk in 0..v {
            for micro in 0..m {
                let (f, b, w) = counts.get(&(chunk, micro)).copied().unwrap_or_default();
                if f == 0 {
                    let action = Action::Forward { chunk, micro };
                    return Err(SimError::MissingCompute { stage, action });
                }
                if b == 0 {
                    let action = Action::Backward { chunk, micro };
                    return Err(SimError::MissingCompute { stage, action });
                }
                if split && w == 0 {
                    let action = Action::Weight { chunk, micro };
                    return Err(SimError::MissingCompute { stage, action });
                }
            }
        }
    }
    for key in order {
        let (sends, recvs) = &messages[&key];
        if sends.len() > recvs.len() {
            let (stage, action) = sends[recvs.len()];
            return Err(SimError::UnmatchedSend { stage, action });
        }
        if recvs.len() > sends.len() {
            let (stage, action) = recvs[sends.len()];
            return Err(SimError::UnmatchedRecv { stage, action });
        }
    }
    Ok(())
}

/// Checks that every point-to-point channel (an ordered pair of stages) receives its messages in
/// the order they are sent. The executor's channels carry no tags (as with NCCL): a message is
/// matched to a receive by its position, so a stage that sends micro-batch 0 then 1 to a stage
/// that receives 1 first would hand micro-batch 0's tensor to micro-batch 1's forward. (The
/// simulator matches messages by key and does not need this.)
pub fn check_fifo(sched: &Schedule) -> Result<(), SimError> {
    type Channel = Vec<(Key, usize, Action)>; // (message, stage, action) in schedule order
    let mut channels: HashMap<(usize, usize), (Channel, Channel)> = HashMap::new();
    for (stage, list) in sched.actions.iter().enumerate() {
        for (index, &action) in list.iter().enumerate() {
            let (ends, is_send) = match action {
                Action::SendActivation { to, .. } | Action::SendGrad { to, .. } => {
                    (channels.entry((stage, to)).or_default(), true)
                }
                Action::RecvActivation { from, .. } | Action::RecvGrad { from, .. } => {
                    (channels.entry((from, stage)).or_default(), false)
                }
                Action::Forward { .. } | Action::Backward { .. } | Action::Weight { .. } => {
                    continue
                }
            };
            let (key, _) = route(sched, stage, index, action)?;
            let side = if is_send { &mut ends.0 } else { &mut ends.1 };
            side.push((key, stage, action));
        }
    }
    let mut names: Vec<&(usize, usize)> = channels.keys().collect();
    names.sort();
    for &(from, to) in names {
        let (sends, recvs) = &channels[&(from, to)];
        for (position, (s, r)) in sends.iter().zip(recvs).enumerate() {
            if s.0 != r.0 {
                return Err(SimError::OutOfOrder {
                    from,
                    to,
                    position,
                    sent: s.2,
                    received: r.2,
                });
            }
        }
        if let Some(&(_, stage, action)) = sends.get(recvs.len()) {
            return Err(SimError::UnmatchedSend { stage, action });
        }
        if let Some(&(_, stage, action)) = recvs.get(sends.len()) {
            return Err(SimError::UnmatchedRecv { stage, action });
        }
    }
    Ok(())
}

/// Checks that a communication action goes to / comes from the stage holding the neighbouring
/// global chunk (never the stage itself: a neighbour on the same stage is handed over), and
/// returns its message key and whether it is a send.
fn route(
    sched: &Schedule,
    stage: usize,
    index: usize,
    action: Action,
) -> Result<(Key, bool), SimError> {
    let g = sched.global_chunk(stage, action.chunk());
    let last = sched.num_chunks() - 1;
    let micro = action.micro();
    let bad = |reason: String| SimError::Misrouted {
        stage,
        index,
        action,
        reason,
    };
    let (needs_next, peer, key, is_send) = match action {
        Action::SendActivation { to, .. } => (true, to, (Payload::Activation, g + 1, micro), true),
        Action::RecvActivation { from, .. } => {
            (false, from, (Payload::Activation, g, micro), false)
        }
        Action::SendGrad { to, .. } => (false, to, (Payload::Grad, g.wrapping_sub(1), micro), true),
        Action::RecvGrad { from, .. } => (true, from, (Payload::Grad, g, micro), false),
        Action::Forward { .. } | Action::Backward { .. } | Action::Weight { .. } => {
            return Err(bad("not a communication".into()))
        }
    };
    if needs_next && g == last {
        return Err(bad(format!("global chunk {g} is the last chunk")));
    }
    if !needs_next && g == 0 {
        return Err(bad("global chunk 0 has no predecessor".into()));
    }
    let neighbour = if needs_next { g + 1 } else { g - 1 };
    let expected = sched.locate(neighbour).0;
    if expected == stage {
        return Err(bad(format!(
            "global chunk {g}'s neighbour {neighbour} is on this stage: handed over, not sent"
        )));
    }
    if peer != expected {
        return Err(bad(format!(
            "global chunk {g}'s neighbour lives on stage {expected}, not {peer}"
        )));
    }
    Ok((key, is_send))
}
