//! Parallel training: the `parallel:` recipe section, the rank mesh, the `Comm` trait and its
//! backends, tensor- and sequence-parallel ops and layers, context-parallel ring attention,
//! expert-parallel token dispatch, data-parallel gradient sync and ZeRO, pipeline schedules, and
//! multi-process launch (environment parsing, rendezvous store).

pub mod comm;
pub mod config;
pub mod cp;
pub mod dp;
pub mod env;
pub mod ep;
pub mod mesh;
pub mod pipeline;
pub mod register;
pub mod stats;
pub mod store;
pub mod tp;

pub use comm::{Channel, Comm, CommError, Group, ReduceOp};
pub use config::ParallelConfig;
