//! `pretrain`: recipes, the optimizer, learning-rate schedules and the training loop. The model,
//! parallelism, data and checkpoints live in the workspace crates.

pub mod cli;
pub mod optim;
pub mod recipe;
pub mod schedule;
pub mod train;
