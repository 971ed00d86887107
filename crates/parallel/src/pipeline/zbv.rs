//! ZBV, the zero-bubble V schedule (Qi et al., "Pipeline Parallelism with Controllable Memory",
//! 2024; torchtitan's `ZBVZeroBubble`): two chunks per stage placed as a V
//! ([`ChunkPlacement::Vee`]: stage `s` holds global chunks `s` and `2·pp − 1 − s`), and
//! backwards split into B (input gradient) and W (weight gradients). The first stage both starts
//! and ends every micro-batch, so each stage's warm-up and cool-down are short and the W actions
//! fill what is left: close to no bubble once `m >= 2·pp`, within 1F1B's peak activations
//! (`pp` micro-batches of a whole stage, i.e. `2·pp` chunk activations).
//!
//! The order is found by a list scheduler, as the paper's heuristic does — on unit costs (F = B =
//! W per chunk) at first, then on the costs training measures ([`Fit`]): every stage, whenever it
//! is free, starts
//!
//! 1. a B whose output gradient is there (the critical path), the one waiting longest first;
//! 2. else a forward whose input is there, the second chunk's first (it leads to the loss and
//!    frees memory soonest), if fewer than the stage's cap of chunk activations are held
//!    (forward done, W not yet; `2·pp` unless the stage weighs more, see [`Fit`]), a first
//!    chunk's leaving one slot free when any stage's cap is lowered;
//! 3. else the oldest W still owed;
//!
//! else it waits for the next message. Receives are placed in the order messages arrive, so every
//! channel is read in the order it is written (tag-less channels need it: a stage's two chunks
//! share channels with both neighbours). Like every schedule here the result is data, validated,
//! simulated and FIFO-checked before training; with other costs it stays correct.

use std::collections::VecDeque;

use super::placement::ChunkPlacement;
use super::schedule::{Action, ScheduleError, ScheduleKind};
use super::sim::SimCosts;

const NEVER: f64 = f64::INFINITY;

/// Per-stage action lists of ZBV for `pp` stages and `m` micro-batches (`v` must be 2).
pub(crate) fn actions(pp: usize, v: usize, m: usize) -> Result<Vec<Vec<Action>>, ScheduleError> {
    fitted(pp, v, m, &Fit::unit(pp))
}

/// What zbv's order is found for: the costs of a chunk's forward, B and W, and per stage how
/// many chunk activations it may hold (forwards whose W has not run).
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// A chunk's forward, B and W.
    pub costs: SimCosts,
    /// Per stage, the chunk activations it may hold (at least 2).
    pub caps: Vec<usize>,
}

impl Fit {
    /// Unit costs, and `2·pp` chunk activations on every stage: 1F1B's first stage holds `pp`
    /// micro-batches of both halves of its layers.
    pub fn unit(pp: usize) -> Self {
        Self {
            costs: SimCosts::default(),
            caps: vec![2 * pp; pp],
        }
    }
}

/// ZBV's order found for `fit` (`v` must be 2, every cap at least 2): the trainer measures a
/// step's forward, B and W actions and orders the following steps for them, and holds a stage
/// whose activations weigh more than the others (the first, with the head) to fewer.
pub(crate) fn fitted(
    pp: usize,
    v: usize,
    m: usize,
    fit: &Fit,
) -> Result<Vec<Vec<Action>>, ScheduleError> {
    if v != 2 {
        return Err(ScheduleError::TwoChunksPerStage {
            kind: ScheduleKind::ZeroBubbleV,
            v,
        });
    }
    if pp < 2 {
        return Err(ScheduleError::VirtualNeedsPipeline { v, pp });
    }
    if fit.caps.len() != pp || fit.caps.iter().any(|&c| c < 2) {
        return Err(ScheduleError::Caps {
            pp,
            caps: fit.caps.clone(),
        });
    }
    Scheduler::new(pp, m, fit.clone())
        .run()
        .ok_or(ScheduleError::Stalled { pp, m })
}

/// What a free stage starts.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Compute {
    Forward(usize),
    Backward(usize),
    Weight,
}

/// One stage of the list scheduler.
struct Stage {
    /// When it is next free.
    clock: f64,
    /// Per local chunk: the next micro-batch to forward and to back-propagate (B).
    f: [usize; 2],
    b: [usize; 2],
    /// When each (chunk, micro-batch)'s input activation / output gradient is there.
    act: [Vec<f64>; 2],
    grad: [Vec<f64>; 2],
    /// W actions owed, oldest first.
    owed: VecDeque<(usize, usize)>,
    /// Chunk activations held: forwards whose W has not run.
    held: usize,
    /// Messages sent here and not yet received: (arrival, sequence number, receive action).
    inbox: Vec<(f64, usize, Action)>,
    list: Vec<Action>,
}

struct Scheduler {
    pp: usize,
    m: usize,
    fit: Fit,
    stages: Vec<Stage>,
    /// Sequence number of the next message (orders messages arriving at the same time).
    sent: usize,
    /// Whether a first-chunk forward leaves a slot free (some stage's cap is below `2·pp`).
    reserve: bool,
}

impl Scheduler {
    fn new(pp: usize, m: usize, fit: Fit) -> Self {
        let stages = (0..pp)
            .map(|s| {
                let mut act = [vec![NEVER; m], vec![NEVER; m]];
                if s == 0 {
                    act[0].fill(0.0); // global chunk 0 reads the data
                }
                Stage {
                    clock: 0.0,
                    f: [0; 2],
                    b: [0; 2],
                    act,
                    grad: [vec![NEVER; m], vec![NEVER; m]],
                    owed: VecDeque::new(),
                    held: 0,
                    inbox: Vec::new(),
                    list: Vec::with_capacity(14 * m),
                }
            })
            .collect();
        // Set before `fit` moves in.
        let reserve = fit.caps.iter().any(|&c| c < 2 * pp);
        Self {
            pp,
            m,
            fit,
            stages,
            sent: 0,
            reserve,
        }
    }

    /// The earliest time stage `s` can start something, and what it starts then: of the
    /// candidates that can start earliest, the first in priority order — B (the longest-waiting
    /// gradient first), F (second chunk first), W.
    fn next(&self, s: usize) -> Option<(f64, Compute)> {
        let (st, m, cap) = (&self.stages[s], self.m, self.fit.caps[s]);
        let at = |ready: f64| ready.max(st.clock);
        let mut best: Option<(f64, Compute)> = None;
        let mut consider = |t: f64, what: Compute| {
            if t < NEVER && best.is_none_or(|(bt, _)| t < bt) {
                best = Some((t, what));
            }
        };
        for c in 0..2 {
            if st.b[c] < st.f[c] {
                consider(at(st.grad[c][st.b[c]]), Compute::Backward(c));
            }
        }
        // When any stage's cap is lowered below `2·pp`, a first-chunk forward (a new
        // micro-batch) leaves a slot for a second-chunk one, so that the micro-batches held can
        // always go on to the loss. It must hold on every stage, not only on the lowered ones: a
        // stage at `2·pp` whose first-chunk inputs keep coming (stage 0 reads the data) would
        // otherwise fill every slot with them while a lowered stage further down holds back the
        // second chunk's inputs, and then neither can move (pp 2, m >= 5, caps [4, 3]: a layout
        // whose first chunk is empty lowers only stage 1). With every cap at `2·pp` the second
        // chunk's inputs arrive in time anyway, and the order is unchanged.
        let reserve = |c: usize| usize::from(c == 0 && self.reserve);
        for c in [1, 0] {
            if st.f[c] < m && st.held + reserve(c) < cap {
                consider(at(st.act[c][st.f[c]]), Compute::Forward(c));
            }
        }
        if !st.owed.is_empty() {
            consider(st.clock, Compute::Weight);
        }
        best
    }

    /// The stages' action lists, or `None` if every stage's memory filled up before the work
    /// was done (not seen for any size the tests cover; the caller reports it).
    fn run(mut self) -> Option<Vec<Vec<Action>>> {
        // Decisions are taken in time order (ties to the lower stage): a decision at `t` can
        // only deliver inputs at its end or later, so no earlier choice is ever revisited.
        // Each stage's next start changes only when it starts something or a message reaches
        // it.
        let mut next: Vec<Option<(f64, Compute)>> = (0..self.pp).map(|s| self.next(s)).collect();
        while let Some((s, (t, what))) = next
            .iter()
            .enumerate()
            .filter_map(|(s, n)| n.map(|n| (s, n)))
            .min_by(|x, y| x.1 .0.total_cmp(&y.1 .0).then(x.0.cmp(&y.0)))
        {
            let reached = self.start(s, t, what);
            next[s] = self.next(s);
            if let Some(r) = reached {
                next[r] = self.next(r);
            }
        }
        let done = |st: &Stage| st.b == [self.m; 2] && st.owed.is_empty();
        self.stages
            .iter()
            .all(done)
            .then(|| self.stages.into_iter().map(|st| st.list).collect())
    }

    /// Stage `s` starts `what` at `t`: the receives of what has arrived by then, the compute,
    /// its send or hand-over. Returns the stage a message went to.
    fn start(&mut self, s: usize, t: f64, what: Compute) -> Option<usize> {
        let cost = match what {
            Compute::Forward(_) => self.fit.costs.forward,
            Compute::Backward(_) => self.fit.costs.backward,
            Compute::Weight => self.fit.costs.weight,
        };
        let (pp, end) = (self.pp, t + cost.max(1e-9));
        let vee = ChunkPlacement::Vee;
        let st = &mut self.stages[s];
        st.inbox
            .sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
        let arrived = st.inbox.partition_point(|x| x.0 <= t);
        st.list.extend(st.inbox.drain(..arrived).map(|x| x.2));
        st.clock = end;
        let (chunk, forward) = match what {
            Compute::Weight => {
                let (chunk, micro) = st.owed.pop_front().expect("a W is owed");
                st.list.push(Action::Weight { chunk, micro });
                st.held -= 1;
                return None;
            }
            Compute::Forward(c) => (c, true),
            Compute::Backward(c) => (c, false),
        };
        let g = vee.global(pp, s, chunk);
        let micro;
        if forward {
            micro = st.f[chunk];
            st.f[chunk] += 1;
            st.held += 1;
            st.list.push(Action::Forward { chunk, micro });
        } else {
            micro = st.b[chunk];
            st.b[chunk] += 1;
            st.owed.push_back((chunk, micro));
            st.list.push(Action::Backward { chunk, micro });
        }
        // Where the result goes: global chunk g + 1 (forward) or g − 1 (backward).
        let target = if forward {
            Some(g + 1).filter(|&n| n < 2 * pp)
        } else {
            g.checked_sub(1)
        };
        let Some(target) = target else {
            if forward {
                st.grad[chunk][micro] = end; // the loss: the last chunk's own gradient
            }
            return None;
        };
        let (to, to_chunk) = vee.locate(pp, target);
        if to == s {
            // Handed over to this stage's other chunk.
            let ready = if forward { &mut st.act } else { &mut st.grad };
            ready[to_chunk][micro] = end;
            return None;
        }
        st.list.push(if forward {
            Action::SendActivation { chunk, micro, to }
        } else {
            Action::SendGrad { chunk, micro, to }
        });
        let (seq, from) = (self.sent, s);
        self.sent += 1;
        let dst = &mut self.stages[to];
        let recv = if forward {
            dst.act[to_chunk][micro] = end;
            Action::RecvActivation {
                chunk: to_chunk,
                micro,
                from,
            }
        } else {
            dst.grad[to_chunk][micro] = end;
            Action::RecvGrad {
                chunk: to_chunk,
                micro,
                from,
            }
        };
        dst.inbox.push((end, seq, recv));
        Some(to)
    }
}
