//! `GradBuffer`: one persistent flat fp32 buffer that accumulates every parameter's gradient
//! across the micro-batches of a step.

use candle_core::{DType, Device, Result, Tensor};

use super::{kernels, FlatLayout};

/// Flat fp32 gradients of all parameters, in `FlatLayout` order.
pub struct GradBuffer {
    flat: Tensor,
    layout: FlatLayout,
}

impl GradBuffer {
    /// A zeroed buffer for `layout`.
    pub fn new(layout: FlatLayout, device: &Device) -> Result<Self> {
        Ok(Self {
            flat: Tensor::zeros(layout.total, DType::F32, device)?,
            layout,
        })
    }

    /// Clears all gradients (start of a step).
    pub fn zero(&self) -> Result<()> {
        self.flat.zero_set()
    }

    /// Adds `grad` into parameter `i`'s slot.
    pub fn accumulate(&self, i: usize, grad: &Tensor) -> Result<()> {
        kernels::add_into(
            &self
                .flat
                .narrow(0, self.layout.offsets[i], self.layout.numels[i])?,
            grad,
        )
    }

    /// Parameter `i`'s gradient, flat `[numel]`.
    pub fn get(&self, i: usize) -> Result<Tensor> {
        self.flat
            .narrow(0, self.layout.offsets[i], self.layout.numels[i])
    }

    /// The whole buffer `[total]`.
    pub fn flat(&self) -> &Tensor {
        &self.flat
    }

    /// `Σ g²` over the whole buffer (f64 accumulation).
    pub fn sum_squares(&self) -> Result<f64> {
        kernels::sum_squares(&self.flat)
    }
}
