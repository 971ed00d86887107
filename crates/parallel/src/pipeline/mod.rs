//! Pipeline-parallel schedules as data.
//!
//! A [`Schedule`] is, per pipeline stage, the ordered list of [`Action`]s (forward / backward of
//! a (chunk, micro-batch), and the sends / receives around them) that stage executes for one
//! training step. [`build`] is the one place mapping a [`ScheduleKind`] to its implementation:
//!
//! - [`afab`]: all-forward-all-backward (GPipe), the reference;
//! - [`one_f_one_b`]: Megatron's 1F1B (warm-up, steady 1F1B, cool-down);
//! - [`interleaved`]: Megatron's interleaved 1F1B with `v` model chunks per stage;
//! - [`zb_h1`]: zero-bubble ZB-H1, 1F1B with split backwards whose weight-gradient actions fill
//!   the cool-down;
//! - [`zbv`]: zero-bubble V, two chunks per stage placed as a V ([`placement`]), split backwards.
//!
//! [`check::validate`] checks a schedule's structure and [`check::check_fifo`] the order of every
//! channel's messages; [`sim::simulate`] executes a schedule without tensors, validating it and
//! measuring makespan, bubble and peak live activations; [`trace::chrome_trace`] renders
//! timelines for Perfetto.
//!
//! # Closed forms (checked by `tests/pipeline_schedules.rs`)
//!
//! With a stage's layers costing `f` forward and `b` backward per micro-batch, split evenly over
//! its `v` chunks (`SimCosts::per_chunk`), every schedule here (GPipe and 1F1B with `v = 1`,
//! interleaved with `m % pp == 0`) takes exactly `m (f + b) + (pp - 1)(f + b) / v`, i.e. a
//! bubble fraction of `(pp - 1) / (v m + pp - 1)`. Peak live activations on stage `s`: GPipe
//! `m`, 1F1B `min(pp - s, m)`, interleaved `min(warmup(s) + 1, m v)` with
//! [`interleaved::warmup_forwards`].

pub mod afab;
pub mod check;
pub mod interleaved;
pub mod one_f_one_b;
pub mod placement;
pub mod register;
pub mod schedule;
pub mod sim;
pub mod trace;
pub mod zb_h1;
pub mod zbv;

pub use check::{check_fifo, validate};
pub use placement::ChunkPlacement;
pub use schedule::{build, build_zb_h1, build_zbv, Action, Schedule, ScheduleError, ScheduleKind};
pub use sim::{simulate, SimCosts, SimError, SimReport, Span};
pub use trace::{chrome_trace, spans_from_timelines, TraceSpan};
