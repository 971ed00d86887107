//! Parallel layout of a training job: the `parallel:` recipe section and the rank layout.

pub mod config;

pub use config::ParallelConfig;
