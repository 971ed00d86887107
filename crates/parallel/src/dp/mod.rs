//! Data parallelism: every data-parallel replica computes gradients on its slice of the global
//! batch, and the replicas' gradients are summed before the optimizer step.
//!
//! - [`layout`]: the flat fp32 buffer every parameter's gradient (and optimizer state) lives in,
//!   cut into buckets padded to a multiple of the data-parallel size;
//! - [`sync`]: [`GradSync`], the overlapped bucket reducer — a bucket whose gradients are final is
//!   all-reduced (or reduce-scattered, ZeRO-1) on a background thread while the backward pass
//!   continues;
//! - [`finalize`]: [`GradFinalizer`], what the step executor calls as each parameter's gradient
//!   becomes final — the partial sums of copies on other ranks of the replica (sequence-parallel
//!   norms, the tied embedding of a pipeline), then the bucket reducer;
//! - [`zero`]: ZeRO-1 ownership (which flat ranges a rank's optimizer updates) and the gathering of
//!   the updated shards.
//!
//! Gradients are summed, not averaged: each micro-batch's loss is already divided by the global
//! batch's token count, which makes the gradient independent of how the batch is split.

pub mod finalize;
pub mod layout;
pub mod sync;
pub mod zero;

pub use finalize::{GradFinalizer, GradGroups, Partial};
pub use layout::{intersect, Bucket, FlatLayout};
pub use sync::{BucketSpan, GradSync};
pub use zero::{gather_shards, owned_ranges};
