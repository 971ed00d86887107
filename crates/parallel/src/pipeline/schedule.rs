//! Pipeline schedules as data: the [`Action`] a pipeline stage performs, the per-stage action
//! lists of a [`Schedule`], the [`ScheduleKind`] selector, the [`ScheduleError`]s of bad sizes,
//! and [`build`], the one place where a schedule kind is turned into action lists.
//!
//! # Chunks and stages
//!
//! A model is cut into `pp * v` consecutive chunks ("global chunks"). Pipeline stage `s` holds
//! the local chunks `c = 0..v`, where local chunk `c` is global chunk `c * pp + s` (Megatron's
//! virtual-pipeline layout; with `v = 1` stage `s` simply holds chunk `s`).
//!
//! Activations of global chunk `g` flow to global chunk `g + 1` (on stage `(s + 1) % pp`, so the
//! last stage wraps around to the first stage's next chunk), gradients flow from `g + 1` back to
//! `g`. Global chunk 0 reads its input from the data (no receive) and the last global chunk
//! computes the loss (its backward needs no received gradient).
//!
//! # Execution model
//!
//! Each stage executes its list in order. Sends are non-blocking (buffered); receives block until
//! the matching send has happened. Every receive is placed immediately before the compute that
//! consumes it and every send immediately after the compute that produces it.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::placement::ChunkPlacement;
use super::{afab, interleaved, one_f_one_b, zb_h1, zbv};

/// One step of a pipeline stage's program.
///
/// `chunk` is always the *local* chunk index (`0..v`) on the stage that executes the action, and
/// `micro` the micro-batch index (`0..m`). For communication, `chunk` names the local chunk that
/// produced (send) or will consume (receive) the tensor; `to` / `from` are pipeline stage indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Run the forward pass of local chunk `chunk` on micro-batch `micro`.
    Forward { chunk: usize, micro: usize },
    /// Run the backward pass of local chunk `chunk` on micro-batch `micro`: its input gradient,
    /// and its weight gradients too unless the schedule has a [`Action::Weight`] for them.
    Backward { chunk: usize, micro: usize },
    /// Accumulate the weight gradients a split backward of (`chunk`, `micro`) left as GEMM
    /// factors (zero-bubble schedules: off the critical path, any time after its
    /// [`Action::Backward`]).
    Weight { chunk: usize, micro: usize },
    /// Send the output activation of (`chunk`, `micro`) to stage `to` (non-blocking).
    SendActivation {
        chunk: usize,
        micro: usize,
        to: usize,
    },
    /// Receive the input activation of (`chunk`, `micro`) from stage `from` (blocking).
    RecvActivation {
        chunk: usize,
        micro: usize,
        from: usize,
    },
    /// Send the input gradient of (`chunk`, `micro`) to stage `to` (non-blocking).
    SendGrad {
        chunk: usize,
        micro: usize,
        to: usize,
    },
    /// Receive the output gradient of (`chunk`, `micro`) from stage `from` (blocking).
    RecvGrad {
        chunk: usize,
        micro: usize,
        from: usize,
    },
}

impl Action {
    /// The local chunk index the action refers to.
    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. }
            | Action::Backward { chunk, .. }
            | Action::Weight { chunk, .. }
            | Action::SendActivation { chunk, .. }
            | Action::RecvActivation { chunk, .. }
            | Action::SendGrad { chunk, .. }
            | Action::RecvGrad { chunk, .. } => chunk,
        }
    }

    /// The micro-batch index the action refers to.
    pub fn micro(&self) -> usize {
        match *self {
            Action::Forward { micro, .. }
            | Action::Backward { micro, .. }
            | Action::Weight { micro, .. }
            | Action::SendActivation { micro, .. }
            | Action::RecvActivation { micro, .. }
            | Action::SendGrad { micro, .. }
            | Action::RecvGrad { micro, .. } => micro,
        }
    }

    /// True for [`Action::Forward`], [`Action::Backward`] and [`Action::Weight`].
    pub fn is_compute(&self) -> bool {
        matches!(
            self,
            Action::Forward { .. } | Action::Backward { .. } | Action::Weight { .. }
        )
    }
}

impl fmt::Display for Action {
    /// Short names, e.g. `F c0 m3`, `B c1 m0`, `W c1 m0`, `send-act c0 m3 -> 1`, `recv-grad c0 m3 <- 2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Action::Forward { chunk, micro } => write!(f, "F c{chunk} m{micro}"),
            Action::Backward { chunk, micro } => write!(f, "B c{chunk} m{micro}"),
            Action::Weight { chunk, micro } => write!(f, "W c{chunk} m{micro}"),
            Action::SendActivation { chunk, micro, to } => {
                write!(f, "send-act c{chunk} m{micro} -> {to}")
            }
            Action::RecvActivation { chunk, micro, from } => {
                write!(f, "recv-act c{chunk} m{micro} <- {from}")
            }
            Action::SendGrad { chunk, micro, to } => {
                write!(f, "send-grad c{chunk} m{micro} -> {to}")
            }
            Action::RecvGrad { chunk, micro, from } => {
                write!(f, "recv-grad c{chunk} m{micro} <- {from}")
            }
        }
    }
}

/// The per-stage programs of one training step of a pipeline group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Number of pipeline stages.
    pub pp: usize,
    /// Virtual stages (model chunks) per pipeline stage.
    pub v: usize,
    /// Micro-batches per step (per data-parallel rank).
    pub m: usize,
    /// `actions[s]` is the execution order of stage `s`.
    pub actions: Vec<Vec<Action>>,
    /// Which global chunks each stage holds.
    pub placement: ChunkPlacement,
}

impl Schedule {
    /// Total number of model chunks, `pp * v`.
    pub fn num_chunks(&self) -> usize {
        self.pp * self.v
    }

    /// Global chunk index of local chunk `chunk` on stage `stage` (`chunk * pp + stage` when
    /// looped).
    pub fn global_chunk(&self, stage: usize, chunk: usize) -> usize {
        self.placement.global(self.pp, stage, chunk)
    }

    /// `(stage, local chunk)` of global chunk `global`.
    pub fn locate(&self, global: usize) -> (usize, usize) {
        self.placement.locate(self.pp, global)
    }

    /// Whether backwards are split: the weight gradients of every (chunk, micro-batch) are
    /// accumulated by a separate [`Action::Weight`] (zero-bubble schedules).
    pub fn splits_backward(&self) -> bool {
        self.actions
            .iter()
            .flatten()
            .any(|a| matches!(a, Action::Weight { .. }))
    }
}

/// Upper bound on `pp * v * m` accepted by [`build`] (keeps the action lists allocatable).
pub const MAX_PAIRS: usize = 1 << 24;

/// Which pipeline schedule to build; see [`build`]. In a recipe: `parallel.schedule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScheduleKind {
    /// GPipe: all forwards, then all backwards (`v = 1` only).
    #[serde(rename = "gpipe")]
    AllForwardAllBackward,
    /// Megatron's non-interleaved 1F1B (`v = 1` only).
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron's interleaved 1F1B with `v` virtual stages per rank (`m % pp == 0`).
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Zero-bubble ZB-H1 (Qi et al. 2024): 1F1B's order with split backwards whose weight
    /// gradients fill the cool-down (`v = 1` only).
    #[serde(rename = "zb-h1")]
    ZeroBubbleH1,
    /// Zero-bubble V (Qi et al. 2024): two chunks per stage placed as a V
    /// ([`ChunkPlacement::Vee`]), split backwards; close to no bubble at `m >= 2 pp` with
    /// 1F1B's peak activation memory (`v = 2` only).
    #[serde(rename = "zbv")]
    ZeroBubbleV,
}

impl ScheduleKind {
    /// The schedule training steps use with `v` model chunks per stage: interleaved 1F1B with
    /// virtual stages, else 1F1B (which for a single stage is the forward then the backward of
    /// each micro-batch in turn).
    pub fn for_virtual_stages(v: usize) -> Self {
        if v > 1 {
            ScheduleKind::Interleaved
        } else {
            ScheduleKind::OneFOneB
        }
    }
}

impl ScheduleKind {
    /// Where its chunks sit: zig-zag for the V schedules, else looped.
    pub fn placement(self) -> ChunkPlacement {
        match self {
            ScheduleKind::ZeroBubbleV => ChunkPlacement::Vee,
            _ => ChunkPlacement::Looped,
        }
    }

    /// The name `parallel.schedule` takes.
    pub fn recipe_name(self) -> &'static str {
        match self {
            ScheduleKind::AllForwardAllBackward => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZeroBubbleH1 => "zb-h1",
            ScheduleKind::ZeroBubbleV => "zbv",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScheduleKind::AllForwardAllBackward => "all-forward-all-backward",
            ScheduleKind::OneFOneB => "1F1B",
            ScheduleKind::Interleaved => "interleaved 1F1B",
            ScheduleKind::ZeroBubbleH1 => "zb-h1",
            ScheduleKind::ZeroBubbleV => "zbv",
        })
    }
}

/// Why a schedule cannot be built for the requested sizes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// `pp == 0`.
    #[error("pp must be at least 1")]
    ZeroStages,
    /// `v == 0`.
    #[error("v (virtual stages per pipeline rank) must be at least 1")]
    ZeroVirtualStages,
    /// `m == 0`.
    #[error("m (micro-batches per step) must be at least 1")]
    ZeroMicroBatches,
    /// A non-interleaved schedule was asked for more than one chunk per rank.
    #[error("{kind} supports only one model chunk per pipeline rank (v = 1), got v = {v}")]
    VirtualNotSupported { kind: ScheduleKind, v: usize },
    /// A V schedule was asked for another number of chunks per stage than two.
    #[error("{kind} runs two model chunks per pipeline rank (v = 2), got v = {v}")]
    TwoChunksPerStage { kind: ScheduleKind, v: usize },
    /// zb-h1's deferrals do not name one count per stage.
    #[error("zb-h1 needs one count of deferred weight actions per stage ({pp}), got {got}")]
    Deferrals { pp: usize, got: usize },
    /// zbv's caps do not name one count of at least 2 per stage.
    #[error("zbv needs a cap of at least 2 chunk activations per stage ({pp}), got {caps:?}")]
    Caps { pp: usize, caps: Vec<usize> },
    /// zbv's list scheduler filled every stage's memory before the step's work was done.
    #[error(
        "zbv found no order for pp = {pp} and m = {m} within 1F1B's activation memory; use \
         zb-h1 or 1f1b"
    )]
    Stalled { pp: usize, m: usize },
    /// Virtual stages without pipeline parallelism.
    #[error("v = {v} virtual stages per rank need parallel.pp >= 2 (got pp = {pp})")]
    VirtualNeedsPipeline { v: usize, pp: usize },
    /// Interleaving requires whole groups of `pp` micro-batches.
    #[error(
        "interleaved 1F1B needs the number of micro-batches ({m}) to be a multiple of \
         parallel.pp ({pp})"
    )]
    MicroBatchesNotMultipleOfPp { m: usize, pp: usize },
    /// `pp * v * m` exceeds [`MAX_PAIRS`].
    #[error(
        "schedule too large: pp ({pp}) * v ({v}) * m ({m}) exceeds {MAX_PAIRS} \
         (chunk, micro-batch) pairs"
    )]
    TooLarge { pp: usize, v: usize, m: usize },
}

/// Build the action lists of `kind` for `pp` stages, `v` chunks per stage and `m` micro-batches.
///
/// This is the single place where a [`ScheduleKind`] is mapped to its implementation.
pub fn build(kind: ScheduleKind, pp: usize, v: usize, m: usize) -> Result<Schedule, ScheduleError> {
    check_sizes(pp, v, m)?;
    let actions = match kind {
        ScheduleKind::AllForwardAllBackward => afab::actions(pp, v, m)?,
        ScheduleKind::OneFOneB => one_f_one_b::actions(pp, v, m)?,
        ScheduleKind::Interleaved => interleaved::actions(pp, v, m)?,
        ScheduleKind::ZeroBubbleH1 => zb_h1::actions(pp, v, m)?,
        ScheduleKind::ZeroBubbleV => zbv::actions(pp, v, m)?,
    };
    let placement = kind.placement();
    Ok(Schedule {
        pp,
        v,
        m,
        actions,
        placement,
    })
}

/// zbv with its order found for `fit` (measured costs, per-stage caps) instead of unit costs
/// and `2·pp` chunk activations per stage (see [`zbv::fitted`]).
pub fn build_zbv(pp: usize, m: usize, fit: &zbv::Fit) -> Result<Schedule, ScheduleError> {
    let mut schedule = build(ScheduleKind::ZeroBubbleV, pp, 2, m)?;
    schedule.actions = zbv::fitted(pp, 2, m, fit)?;
    Ok(schedule)
}

/// zb-h1 with stage `s` deferring `deferred[s]` weight actions instead of `s` (see
/// [`zb_h1::actions_deferring`]).
pub fn build_zb_h1(pp: usize, m: usize, deferred: &[usize]) -> Result<Schedule, ScheduleError> {
    let mut schedule = build(ScheduleKind::ZeroBubbleH1, pp, 1, m)?;
    schedule.actions = zb_h1::actions_deferring(pp, m, deferred)?;
    Ok(schedule)
}

/// Checks shared by every schedule: non-zero sizes and no overflow.
fn check_sizes(pp: usize, v: usize, m: usize) -> Result<(), ScheduleError> {
    if pp == 0 {
        return Err(ScheduleError::ZeroStages);
    }
    if v == 0 {
        return Err(ScheduleError::ZeroVirtualStages);
    }
    if m == 0 {
        return Err(ScheduleError::ZeroMicroBatches);
    }
    let pairs = pp.checked_mul(v).and_then(|x| x.checked_mul(m));
    if pairs.is_none_or(|n| n > MAX_PAIRS) {
        return Err(ScheduleError::TooLarge { pp, v, m });
    }
    Ok(())
}

/// The stage holding global chunk `global - 1` (`before`) or `global + 1`, when it exists and
/// is not `stage` itself (a chunk's neighbour on the same stage is handed over, not sent).
pub(crate) fn peer(
    placement: ChunkPlacement,
    (pp, v, stage): (usize, usize, usize),
    global: usize,
    before: bool,
) -> Option<usize> {
    let neighbour = if before {
        global.checked_sub(1)?
    } else {
        Some(global + 1).filter(|&g| g < pp * v)?
    };
    Some(placement.locate(pp, neighbour).0).filter(|&s| s != stage)
}

/// Appends the forward of local `chunk` on `micro` for `stage` (looped placement), wrapped in
/// its communication: receive the input activation (unless this is global chunk 0), compute,
/// send the output activation (unless this is the last global chunk).
pub(crate) fn push_forward(
    list: &mut Vec<Action>,
    at: (usize, usize, usize),
    chunk: usize,
    micro: usize,
) {
    push_forward_in(ChunkPlacement::Looped, list, at, chunk, micro);
}

/// [`push_forward`] for chunks placed as `placement` (nothing sent to or received from the
/// stage itself).
pub(crate) fn push_forward_in(
    placement: ChunkPlacement,
    list: &mut Vec<Action>,
    at: (usize, usize, usize),
    chunk: usize,
    micro: usize,
) {
    let global = placement.global(at.0, at.2, chunk);
    if let Some(from) = peer(placement, at, global, true) {
        list.push(Action::RecvActivation { chunk, micro, from });
    }
    list.push(Action::Forward { chunk, micro });
    if let Some(to) = peer(placement, at, global, false) {
        list.push(Action::SendActivation { chunk, micro, to });
    }
}

/// Appends the backward of local `chunk` on `micro` for `stage` (looped placement), wrapped in
/// its communication: receive the output gradient (unless this is the last global chunk, which
/// owns the loss), compute, send the input gradient (unless this is global chunk 0).
pub(crate) fn push_backward(
    list: &mut Vec<Action>,
    at: (usize, usize, usize),
    chunk: usize,
    micro: usize,
) {
    let global = ChunkPlacement::Looped.global(at.0, at.2, chunk);
    let looped = ChunkPlacement::Looped;
    if let Some(from) = peer(looped, at, global, false) {
        list.push(Action::RecvGrad { chunk, micro, from });
    }
    list.push(Action::Backward { chunk, micro });
    if let Some(to) = peer(looped, at, global, true) {
        list.push(Action::SendGrad { chunk, micro, to });
    }
}
