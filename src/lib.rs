//! `pretrain`: recipes, the optimizer, learning-rate schedules, the training loop and the
//! multi-process launcher. The model, parallelism, data and checkpoints live in the workspace
//! crates.

pub mod cli;
pub mod device;
pub mod eval;
pub mod hf;
pub mod launch;
pub mod lr;
pub mod optim;
pub mod plan;
pub mod recipe;
pub mod selftest;
pub mod train;

/// The process allocator: mimalloc keeps freed pages for reuse, where the system allocator returns
/// large activation buffers to the kernel after every op (measured: ~20% of a CPU training step in
/// page faults, zeroing and TLB shootdowns). The binary and the benchmarks install it with
/// `#[global_allocator] static GLOBAL: pretrain::Allocator = pretrain::Allocator {};`.
pub type Allocator = mimalloc::MiMalloc;
