//! Data parallelism: every data-parallel replica computes gradients on its slice of the global
//! batch, and the replicas' gradients are summed before the optimizer step.
//!
//! - [`layout`]: the flat fp32 buffer every parameter's gradient (and optimizer state) lives in,
//!   cut into buckets padded to a multiple of the data-parallel size;
//! - [`sync`]: [`GradSync`], the overlapped bucket reducer — a bucket whose gradients are final is
//!   all-reduced (or reduce-scattered, ZeRO-1) on a background thread while the backward pass
//!   continues;
//! - [`rank`]: [`DataParallel`], what the step executor's hooks drive: gradient finalisation at
//!   every ZeRO stage (the partial sums of copies on other ranks of the replica, then the bucket
//!   reducer or, at stages 2 and 3, per-piece reduce-scatters into this rank's shards) and the
//!   gathering of sharded parameters at stage 3;
//! - [`zero`]: ZeRO ownership (which flat ranges a rank's optimizer updates) and the gathering of
//!   the updated shards;
//! - [`stage`]: the ZeRO stage as a type, with the bytes of a rank's state at each stage;
//! - [`staging`]: the ZeRO-2/3 reductions handed to the communication thread, and the bound on
//!   the staging buffers they hold;
//! - [`state`]: the layout of a rank's gradient and optimizer state at its stage;
//! - [`norm`]: the global gradient norm, each element counted once over the job;
//! - [`matrices`]: whole matrices for an optimizer that transforms each as one (Muon), from
//!   their tensor-parallel blocks and ZeRO shards, the work spread over the shard group;
//! - [`gather`]: ZeRO-3's [`Gatherer`], which installs the full parameters of the piece being
//!   computed in the model's parameter slots ([`ParamSlots`]).
//!
//! Gradients are summed, not averaged: each micro-batch's loss is already divided by the global
//! batch's token count, which makes the gradient independent of how the batch is split.

pub mod gather;
pub mod layout;
pub mod matrices;
pub mod norm;
pub mod rank;
pub mod register;
pub mod stage;
pub mod staging;
pub mod state;
pub mod sync;
pub mod zero;

pub use gather::{GatherStats, Gatherer, ParamSlots, Pass};
pub use layout::{intersect, Bucket, FlatLayout};
pub use matrices::{assign_owners, Matrix, MatrixGroups, Spread, WholeMatrices};
pub use norm::{global_sum_squares, norm_runs};
pub use rank::{gather_owned, DataParallel, Partial};
pub use stage::{StateBytes, ZeroStage};
pub use staging::STAGED_IN_FLIGHT;
pub use state::{unit_buckets, StateLayout};
pub use sync::{BucketSpan, GradSync, Reduction};
pub use zero::{
    moved, owned_ranges, publish_bucket, publish_shards, publish_shards_into, ShardPos,
};
