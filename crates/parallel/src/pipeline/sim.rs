//! A tensor-free simulator for [`Schedule`]s: [`simulate`] checks that a schedule is complete and
//! consistent, executes every stage's action list with configurable compute costs
//! ([`SimCosts`]), and returns per-stage timelines and statistics ([`SimReport`]) or the first
//! problem found ([`SimError`]).
//!
//! Execution model (the one the real executor follows): a stage runs its actions in order; a
//! forward costs `SimCosts::forward`, a backward `SimCosts::backward` plus, unless the schedule
//! splits backwards, `SimCosts::weight`, and a weight action `SimCosts::weight`; sends take no
//! time and
//! never block (buffered); a receive blocks until the matching send has happened and then moves
//! the stage's clock to at least the send time. Because stages only interact through messages,
//! running each stage as far as it can go, round-robin, yields exactly the times of a lock-step
//! event-ordered execution; when a full round makes no progress the schedule is deadlocked.
//!
//! Checks, in order: static structure (stage count, indices in range, every (chunk, micro) has
//! exactly one forward and one backward per stage, every message goes between the right stages
//! and has exactly one matching send and receive) and then, while executing: a backward before
//! its forward, a weight action before its backward, a compute before its input arrived, a send before the compute producing it, and
//! deadlock.

use super::check::{validate, Key, Payload};
use super::schedule::{Action, Schedule};

/// Compute cost of one forward / backward of one chunk, in arbitrary time units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimCosts {
    /// Duration of a forward of one chunk on one micro-batch.
    pub forward: f64,
    /// Duration of the input-gradient part of a backward (B) of one chunk on one micro-batch.
    pub backward: f64,
    /// Duration of its weight-gradient part (W): an [`Action::Weight`] of a split schedule, else
    /// part of the backward.
    pub weight: f64,
}

impl Default for SimCosts {
    /// `forward = backward = weight = 1` (a whole backward costs 2).
    fn default() -> Self {
        SimCosts {
            forward: 1.0,
            backward: 1.0,
            weight: 1.0,
        }
    }
}

impl SimCosts {
    /// Costs of a whole stage's layers (`forward`, whole `backward`) split evenly over `v`
    /// chunks, with no separate weight part.
    pub fn per_chunk(forward: f64, backward: f64, v: usize) -> Self {
        Self::split_per_chunk(forward, backward, 0.0, v)
    }

    /// Costs of a whole stage's layers (`forward`, input gradient `backward`, weight gradient
    /// `weight`) split evenly over `v` chunks.
    pub fn split_per_chunk(forward: f64, backward: f64, weight: f64, v: usize) -> Self {
        let v = v.max(1) as f64;
        SimCosts {
            forward: forward / v,
            backward: backward / v,
            weight: weight / v,
        }
    }
}

/// One executed compute action of a stage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// Start time.
    pub start: f64,
    /// End time.
    pub end: f64,
    /// The [`Action::Forward`], [`Action::Backward`] or [`Action::Weight`] executed.
    pub action: Action,
}

/// Result of a successful simulation.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    /// Compute spans of every stage, in execution order.
    pub timelines: Vec<Vec<Span>>,
    /// Time at which the last stage finishes.
    pub makespan: f64,
    /// Total compute time of each stage.
    pub compute_time: Vec<f64>,
    /// Per-stage bubble fraction, `1 - compute_time[s] / makespan`.
    pub bubble: Vec<f64>,
    /// Mean of [`SimReport::bubble`] over stages.
    pub bubble_fraction: f64,
    /// Per stage, the largest number of forwards whose backward (in a split schedule: whose
    /// weight action) had not yet run.
    pub peak_in_flight: Vec<usize>,
}

/// A problem found in a schedule; `stage` is a pipeline stage index, `index` a position in its
/// action list.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// Costs must be finite and non-negative.
    #[error(
        "compute costs must be finite and >= 0 (forward {forward}, backward {backward}, weight \
         {weight})"
    )]
    InvalidCosts {
        forward: f64,
        backward: f64,
        weight: f64,
    },
    /// `pp`, `v` or `m` is zero, or `pp * v * m` overflows.
    #[error("schedule sizes must be at least 1 and small enough (pp {pp}, v {v}, m {m})")]
    BadSizes { pp: usize, v: usize, m: usize },
    /// `actions.len() != pp`.
    #[error("schedule has {got} action lists but pp = {pp}")]
    StageCount { pp: usize, got: usize },
    /// A chunk, micro-batch or stage index out of range.
    #[error("stage {stage} action {index} `{action}` is out of range (pp {pp}, v {v}, m {m})")]
    OutOfRange {
        stage: usize,
        index: usize,
        action: Action,
        pp: usize,
        v: usize,
        m: usize,
    },
    /// A forward or backward appears more than once.
    #[error("stage {stage} runs `{action}` more than once")]
    DuplicateCompute { stage: usize, action: Action },
    /// A forward or backward never appears.
    #[error("stage {stage} never runs `{action}`")]
    MissingCompute { stage: usize, action: Action },
    /// A send or receive to / from the wrong stage, or one that should not exist.
    #[error("stage {stage} action {index} `{action}` is misrouted: {reason}")]
    Misrouted {
        stage: usize,
        index: usize,
        action: Action,
        reason: String,
    },
    /// A send that no receive consumes.
    #[error("stage {stage} `{action}` has no matching receive")]
    UnmatchedSend { stage: usize, action: Action },
    /// A receive that no send feeds.
    #[error("stage {stage} `{action}` has no matching send")]
    UnmatchedRecv { stage: usize, action: Action },
    /// A channel between two stages receives its messages in another order than it sends them
    /// (see [`check_fifo`](super::check::check_fifo)).
    #[error(
        "channel stage {from} -> stage {to}: message {position} is sent by `{sent}` but received \
         by `{received}` (channels carry no tags: receives must follow the send order)"
    )]
    OutOfOrder {
        from: usize,
        to: usize,
        position: usize,
        sent: Action,
        received: Action,
    },
    /// A backward before the forward of the same (chunk, micro).
    #[error("stage {stage} runs `{action}` before its forward")]
    BackwardBeforeForward { stage: usize, action: Action },
    /// A weight action before the backward of the same (chunk, micro).
    #[error("stage {stage} runs `{action}` before its backward")]
    WeightBeforeBackward { stage: usize, action: Action },
    /// A compute whose input (activation or gradient) has not been received yet.
    #[error("stage {stage} runs `{action}` before its input was received")]
    InputNotReceived { stage: usize, action: Action },
    /// A send before the compute that produces the tensor.
    #[error("stage {stage} runs `{action}` before the compute that produces it")]
    SendBeforeCompute { stage: usize, action: Action },
    /// No stage can progress.
    #[error("deadlock: no stage can progress; stuck: {}", stuck_list(.stuck))]
    Deadlock { stuck: Vec<(usize, Action)> },
}

fn stuck_list(stuck: &[(usize, Action)]) -> String {
    let parts: Vec<String> = stuck
        .iter()
        .map(|(s, a)| format!("stage {s} waiting at `{a}`"))
        .collect();
    parts.join(", ")
}

/// Simulates `schedule` with `costs`; see the module docs for the model and the checks.
pub fn simulate(schedule: &Schedule, costs: SimCosts) -> Result<SimReport, SimError> {
    let (f, b, w) = (costs.forward, costs.backward, costs.weight);
    if ![f, b, w].iter().all(|c| c.is_finite() && *c >= 0.0) {
        return Err(SimError::InvalidCosts {
            forward: f,
            backward: b,
            weight: w,
        });
    }
    validate(schedule)?;
    execute(schedule, costs)
}

/// [`simulate`] of a schedule a builder of this module has just made, without validating it
/// again (every builder's output validates: `tests/pipeline_schedules.rs`): the planner
/// simulates thousands of them, and validation is half of a simulation's time.
pub fn simulate_built(schedule: &Schedule, costs: SimCosts) -> Result<SimReport, SimError> {
    if ![costs.forward, costs.backward, costs.weight]
        .iter()
        .all(|c| c.is_finite() && *c >= 0.0)
    {
        return simulate(schedule, costs); // the same error
    }
    debug_assert!(validate(schedule).is_ok());
    execute(schedule, costs)
}

/// Per-stage execution state.
struct StageState {
    pc: usize,
    clock: f64,
    in_flight: usize,
    peak: usize,
    compute: f64,
    spans: Vec<Span>,
    /// Local (chunk, micro-batch) pairs forwarded and back-propagated.
    forwarded: Table<bool>,
    backwarded: Table<bool>,
    /// Messages received, by [`Key`].
    received: Table<bool>,
}

impl StageState {
    fn new(sched: &Schedule) -> Self {
        let (local, keys) = (sched.v * sched.m, 2 * sched.num_chunks() * sched.m);
        Self {
            pc: 0,
            clock: 0.0,
            in_flight: 0,
            peak: 0,
            compute: 0.0,
            spans: Vec::new(),
            forwarded: Table::new(local, false),
            backwarded: Table::new(local, false),
            received: Table::new(keys, false),
        }
    }
}

/// A dense table over small indices (the simulator looks up and marks tens of thousands of
/// (chunk, micro-batch) pairs per schedule): an index past its end reads as the default and
/// is not stored, so a malformed schedule fails its checks instead of panicking.
struct Table<T> {
    cells: Vec<T>,
    default: T,
}

impl<T: Copy> Table<T> {
    fn new(n: usize, default: T) -> Self {
        Self {
            cells: vec![default; n],
            default,
        }
    }

    fn get(&self, i: Option<usize>) -> T {
        i.and_then(|i| self.cells.get(i).copied())
            .unwrap_or(self.default)
    }

    fn set(&mut self, i: Option<usize>, v: T) {
        if let Some(c) = i.and_then(|i| self.cells.get_mut(i)) {
            *c = v;
        }
    }
}

/// Where a local (chunk, micro-batch) pair of `sched` sits in a [`Table`].
fn local(sched: &Schedule, (chunk, micro): (usize, usize)) -> Option<usize> {
    (chunk < sched.v && micro < sched.m).then(|| chunk * sched.m + micro)
}

/// Where a message [`Key`] of `sched` sits in a [`Table`].
fn message(sched: &Schedule, (payload, g, micro): Key) -> Option<usize> {
    let p = match payload {
        Payload::Activation => 0,
        Payload::Grad => 1,
    };
    let n = sched.num_chunks();
    (g < n && micro < sched.m).then(|| (p * n + g) * sched.m + micro)
}

/// Executes the action lists round-robin, each stage as far as it can go, until all finish or
/// no stage can progress.
fn execute(sched: &Schedule, costs: SimCosts) -> Result<SimReport, SimError> {
    let last = sched.num_chunks() - 1;
    let split = sched.splits_backward();
    let mut states: Vec<StageState> = (0..sched.pp).map(|_| StageState::new(sched)).collect();
    // When each message was sent (NaN: not sent, or already received).
    let mut posted = Table::new(2 * sched.num_chunks() * sched.m, f64::NAN);
    let at = |pair| local(sched, pair);
    loop {
        let mut progressed = false;
        for (stage, st) in states.iter_mut().enumerate() {
            let list = &sched.actions[stage];
            while let Some(&action) = list.get(st.pc) {
                let (chunk, micro) = (action.chunk(), action.micro());
                let g = sched.global_chunk(stage, chunk);
                match action {
                    Action::Weight { .. } => {
                        if !st.backwarded.get(at((chunk, micro))) {
                            return Err(SimError::WeightBeforeBackward { stage, action });
                        }
                        let start = st.clock;
                        st.clock += costs.weight;
                        st.compute += costs.weight;
                        st.spans.push(Span {
                            start,
                            end: st.clock,
                            action,
                        });
                        st.in_flight -= 1;
                    }
                    Action::Forward { .. } | Action::Backward { .. } => {
                        let forward = matches!(action, Action::Forward { .. });
                        if !forward && !st.forwarded.get(at((chunk, micro))) {
                            return Err(SimError::BackwardBeforeForward { stage, action });
                        }
                        // The input: received, handed over by this stage's neighbouring
                        // chunk, or none (the first chunk's forward, the last's backward).
                        let neighbour = if forward {
                            g.checked_sub(1)
                        } else {
                            Some(g + 1).filter(|&n| n <= last)
                        };
                        let has_input = match neighbour.map(|n| sched.locate(n)) {
                            None => true,
                            Some((s, c)) if s == stage => {
                                let done = if forward {
                                    &st.forwarded
                                } else {
                                    &st.backwarded
                                };
                                done.get(at((c, micro)))
                            }
                            Some(_) => {
                                let payload = if forward {
                                    Payload::Activation
                                } else {
                                    Payload::Grad
                                };
                                st.received.get(message(sched, (payload, g, micro)))
                            }
                        };
                        if !has_input {
                            return Err(SimError::InputNotReceived { stage, action });
                        }
                        let cost = match (forward, split) {
                            (true, _) => costs.forward,
                            (false, true) => costs.backward,
                            (false, false) => costs.backward + costs.weight,
                        };
                        let start = st.clock;
                        st.clock += cost;
                        st.compute += cost;
                        st.spans.push(Span {
                            start,
                            end: st.clock,
                            action,
                        });
                        if forward {
                            st.forwarded.set(at((chunk, micro)), true);
                            st.in_flight += 1;
                            st.peak = st.peak.max(st.in_flight);
                        } else {
                            st.backwarded.set(at((chunk, micro)), true);
                            if !split {
                                st.in_flight -= 1;
                            }
                        }
                    }
                    Action::SendActivation { .. } | Action::SendGrad { .. } => {
                        let (done, key) = match action {
                            Action::SendActivation { .. } => {
                                (&st.forwarded, (Payload::Activation, g + 1, micro))
                            }
                            _ => (&st.backwarded, (Payload::Grad, g - 1, micro)),
                        };
                        if !done.get(at((chunk, micro))) {
                            return Err(SimError::SendBeforeCompute { stage, action });
                        }
                        posted.set(message(sched, key), st.clock);
                    }
                    Action::RecvActivation { .. } | Action::RecvGrad { .. } => {
                        let payload = match action {
                            Action::RecvActivation { .. } => Payload::Activation,
                            _ => Payload::Grad,
                        };
                        let key = message(sched, (payload, g, micro));
                        let sent_at = posted.get(key);
                        if sent_at.is_nan() {
                            break; // blocked until the matching send happens
                        }
                        posted.set(key, f64::NAN);
                        st.clock = st.clock.max(sent_at);
                        st.received.set(key, true);
                    }
                }
                st.pc += 1;
                progressed = true;
            }
        }
        let stuck: Vec<(usize, Action)> = states
            .iter()
            .enumerate()
            .filter_map(|(s, st)| sched.actions[s].get(st.pc).map(|&a| (s, a)))
            .collect();
        if stuck.is_empty() {
            break;
        }
        if !progressed {
            return Err(SimError::Deadlock { stuck });
        }
    }
    Ok(report(states))
}

/// Summarises the finished stages.
fn report(states: Vec<StageState>) -> SimReport {
    let makespan = states.iter().map(|s| s.clock).fold(0.0, f64::max);
    let compute_time: Vec<f64> = states.iter().map(|s| s.compute).collect();
    let bubble: Vec<f64> = compute_time
        .iter()
        .map(|&c| {
            if makespan > 0.0 {
                1.0 - c / makespan
            } else {
                0.0
            }
        })
        .collect();
    let bubble_fraction = bubble.iter().sum::<f64>() / bubble.len().max(1) as f64;
    let peak_in_flight = states.iter().map(|s| s.peak).collect();
    let timelines = states.into_iter().map(|s| s.spans).collect();
    SimReport {
        timelines,
        makespan,
        compute_time,
        bubble,
        bubble_fraction,
        peak_in_flight,
    }
}
