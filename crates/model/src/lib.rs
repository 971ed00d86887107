//! model
pub mod ops;
