//! The optimizer side of a step: persistent flat fp32 gradient buffers, AdamW with fp32 master
//! weights and moments, weight-decay masks and global-norm clipping.

mod adamw;
mod grads;
pub mod kernels;

pub use adamw::{AdamW, AdamWState};
pub use grads::GradBuffer;

use model::ParamSet;

/// Where each parameter lives in the flat buffers: `offsets[i]..offsets[i] + numel[i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatLayout {
    /// Start of each parameter.
    pub offsets: Vec<usize>,
    /// Elements of each parameter.
    pub numels: Vec<usize>,
    /// Total elements.
    pub total: usize,
}

impl FlatLayout {
    /// Parameters laid out back to back in `ParamSet` order.
    pub fn of(params: &ParamSet) -> Self {
        let numels: Vec<usize> = params.iter().map(|p| p.var.elem_count()).collect();
        let mut offsets = Vec::with_capacity(numels.len());
        let mut total = 0;
        for n in &numels {
            offsets.push(total);
            total += n;
        }
        Self {
            offsets,
            numels,
            total,
        }
    }
}
