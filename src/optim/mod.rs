//! The optimizer side of a step: persistent flat fp32 gradient buffers, AdamW with fp32 master
//! weights and moments over the flat ranges a rank owns (everything, or its ZeRO-1 shards),
//! weight-decay masks and global-norm clipping.

mod adamw;
mod grads;
pub mod kernels;

pub use adamw::{AdamW, AdamWState};
pub use grads::GradBuffer;
pub use parallel::dp::FlatLayout;

use candle_core::{DType, Result, Tensor};
use model::ParamSet;

/// The layout of `params` in buckets of at least `bucket_size` elements, padded for `dp_size`
/// data-parallel ranks.
pub fn layout_of(params: &ParamSet, bucket_size: usize, dp_size: usize) -> FlatLayout {
    let numels: Vec<usize> = params.iter().map(|p| p.numel()).collect();
    FlatLayout::new(&numels, bucket_size, dp_size)
}

/// All parameters as one flat f32 vector `[layout.total]` (padding zero).
pub fn flatten_params(params: &ParamSet, layout: &FlatLayout) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(2 * params.len());
    let mut end = 0;
    for (i, p) in params.iter().enumerate() {
        let r = layout.range(i);
        if r.start > end {
            parts.push(Tensor::zeros(r.start - end, DType::F32, &p.device)?);
        }
        parts.push(p.tensor()?.to_dtype(DType::F32)?.flatten_all()?);
        end = r.end;
    }
    if let (true, Some(p)) = (layout.total > end, params.iter().next()) {
        parts.push(Tensor::zeros(layout.total - end, DType::F32, &p.device)?);
    }
    Tensor::cat(&parts, 0)
}

/// Writes a whole flat f32 vector `[layout.total]` into the parameters (cast to their dtype).
pub fn write_params(params: &ParamSet, layout: &FlatLayout, flat: &Tensor) -> Result<()> {
    for (i, p) in params.iter().enumerate() {
        let r = layout.range(i);
        p.set(&flat.narrow(0, r.start, r.len())?)?;
    }
    Ok(())
}
