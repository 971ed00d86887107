//! The rendezvous of the `local` backend: [`GroupState`] matches the members' calls of one group
//! into slots by sequence number, checks that they agree, and computes each collective once.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use candle_core::{DType, DeviceLocation, Shape, Tensor};

use super::{lock, wait_until, Call};
use crate::comm::collective::{compute, Kind};
use crate::comm::{Group, Result};

/// What one member brings to a collective; all members' signatures must be equal.
#[derive(Debug, Clone, PartialEq)]
struct Signature {
    kind: Kind,
    tensor: Option<(Shape, DType, DeviceLocation)>,
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            Kind::AllReduce(op) => write!(f, "all_reduce({op:?})")?,
            Kind::AllGather(dim) => write!(f, "all_gather(dim {dim})")?,
            Kind::ReduceScatter(dim) => write!(f, "reduce_scatter(dim {dim})")?,
            Kind::Broadcast(root) => write!(f, "broadcast(root {root})")?,
            Kind::Barrier => write!(f, "barrier")?,
        }
        match &self.tensor {
            Some((shape, dtype, device)) => write!(f, " of {shape:?} {dtype:?} on {device:?}"),
            None => Ok(()),
        }
    }
}

/// How a slot failed, shared by all of its members.
enum SlotError {
    Invalid(String),
    /// The members that had not arrived when a waiter gave up.
    Timeout(Vec<usize>),
}

/// Progress of one collective.
enum SlotState {
    /// Waiting for members; holds the contributions in member order.
    Gathering(Vec<Option<Tensor>>),
    /// The last member is computing the result.
    Computing,
    /// One result per member (`None` for a barrier), taken by its member.
    Done(Vec<Option<Tensor>>),
    Failed(SlotError),
}

/// One collective call, matched across the members by sequence number.
struct Slot {
    /// The first arrival's member index and signature.
    first: (usize, Signature),
    arrived: Vec<bool>,
    state: SlotState,
    /// Members that have collected their outcome.
    taken: usize,
}

/// Matching state of one group.
struct GroupInner {
    /// Next sequence number of each member.
    next_seq: Vec<u64>,
    slots: HashMap<u64, Slot>,
}

/// The state of one group: its slots behind a mutex, and a condition variable to wait on.
pub(super) struct GroupState {
    inner: Mutex<GroupInner>,
    cv: Condvar,
}

impl GroupState {
    /// The state of a group of `size` members that has not run anything yet.
    pub(super) fn new(size: usize) -> Self {
        let inner = GroupInner {
            next_seq: vec![0; size],
            slots: HashMap::new(),
        };
        Self {
            inner: Mutex::new(inner),
            cv: Condvar::new(),
        }
    }

    /// Wakes every waiter (after a failure was recorded), taking the lock first so that no
    /// waiter misses the wake-up between its failure check and its wait.
    pub(super) fn wake_all(&self) {
        let _guard = lock(&self.inner);
        self.cv.notify_all();
    }

    /// Number of slots alive.
    pub(super) fn pending(&self) -> usize {
        lock(&self.inner).slots.len()
    }

    /// Runs member `me`'s next collective `kind` with tensor `t` (`None` for a barrier), waiting
    /// until `deadline`; returns this member's result (`None` for a barrier).
    pub(super) fn run(
        &self,
        call: &Call<'_>,
        group: &Group,
        me: usize,
        kind: Kind,
        t: Option<&Tensor>,
        deadline: Instant,
    ) -> Result<Option<Tensor>> {
        let n = group.size();
        let sig = Signature {
            kind,
            tensor: t.map(|t| (t.shape().clone(), t.dtype(), t.device().location())),
        };
        let mut inner = lock(&self.inner);
        let seq = inner.next_seq[me];
        inner.next_seq[me] += 1;
        let slot = inner.slots.entry(seq).or_insert_with(|| Slot {
            first: (me, sig.clone()),
            arrived: vec![false; n],
            state: SlotState::Gathering(vec![None; n]),
            taken: 0,
        });
        slot.arrived[me] = true;
        let mut inputs = None;
        if let SlotState::Gathering(contribs) = &mut slot.state {
            if sig != slot.first.1 {
                let (first, first_sig) = (group.ranks()[slot.first.0], &slot.first.1);
                let message = format!(
                    "call #{seq} on this group does not match: rank {} passed {sig}, \
                     rank {first} passed {first_sig}",
                    call.me
                );
                slot.state = SlotState::Failed(SlotError::Invalid(message));
                self.cv.notify_all();
            } else {
                contribs[me] = t.map(Tensor::detach);
                if slot.arrived.iter().all(|&a| a) {
                    inputs = Some(std::mem::take(contribs));
                    slot.state = SlotState::Computing;
                }
            }
        }
        if let Some(inputs) = inputs {
            // Last to arrive: compute once, without holding the group's lock.
            drop(inner);
            let outcome = compute(kind, group, inputs.into_iter().flatten().collect());
            inner = lock(&self.inner);
            if let Some(slot) = inner.slots.get_mut(&seq) {
                if matches!(slot.state, SlotState::Computing) {
                    slot.state = match outcome {
                        Ok(results) => SlotState::Done(results),
                        Err(e) => SlotState::Failed(SlotError::Invalid(e.to_string())),
                    };
                }
            }
            self.cv.notify_all();
        }
        loop {
            let Some(slot) = inner.slots.get_mut(&seq) else {
                return Err(call.invalid(format!("internal: slot #{seq} vanished")));
            };
            let outcome = match &mut slot.state {
                SlotState::Done(results) => Some(Ok(results[me].take())),
                SlotState::Failed(SlotError::Invalid(msg)) => Some(Err(call.invalid(msg.clone()))),
                SlotState::Failed(SlotError::Timeout(missing)) => {
                    Some(Err(call.timeout(missing.clone())))
                }
                SlotState::Gathering(_) | SlotState::Computing => call.peer_failed().map(Err),
            };
            if let Some(outcome) = outcome {
                slot.taken += 1;
                if slot.taken == n {
                    inner.slots.remove(&seq);
                }
                return outcome;
            }
            inner = match wait_until(&self.cv, inner, deadline) {
                Some(guard) => guard,
                None => {
                    let mut guard = lock(&self.inner);
                    let state = guard.slots.get(&seq).map(|s| &s.state);
                    if matches!(state, Some(SlotState::Computing)) {
                        // Everyone arrived and the result is being computed: wait for it.
                        self.cv.wait(guard).unwrap_or_else(|e| e.into_inner())
                    } else {
                        // Give up while peers are still missing: the slot fails for every member,
                        // late arrivals included. A finished slot is left as it is.
                        if let Some(slot) = guard.slots.get_mut(&seq) {
                            if matches!(slot.state, SlotState::Gathering(_)) {
                                let missing = (0..n).filter(|&i| !slot.arrived[i]);
                                let missing = missing.map(|i| group.ranks()[i]).collect();
                                slot.state = SlotState::Failed(SlotError::Timeout(missing));
                            }
                        }
                        self.cv.notify_all();
                        guard
                    }
                }
            };
        }
    }
}
