//! `GradBuffer`: one persistent flat fp32 buffer that accumulates every parameter's gradient
//! across the micro-batches of a step.

use std::ops::Range;

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

    /// The layout.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// `Σ g²` over a flat range (f64 accumulation).
    pub fn sum_squares(&self, r: Range<usize>) -> Result<f64> {
        if r.is_empty() {
            return Ok(0.0);
        }
        kernels::sum_squares(&self.flat.narrow(0, r.start, r.len())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulates_into_slots_and_zeroes() {
        let layout = FlatLayout::new(&[2, 3], 1 << 20, 1);
        let g = GradBuffer::new(layout, &Device::Cpu).unwrap();
        let a = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let b = Tensor::new(&[[1f64, 1.0, 1.0]], &Device::Cpu).unwrap();
        g.accumulate(0, &a).unwrap();
        g.accumulate(0, &a).unwrap();
        g.accumulate(1, &b).unwrap();
        assert_eq!(
            g.flat().to_vec1::<f32>().unwrap(),
            vec![2.0, 4.0, 1.0, 1.0, 1.0]
        );
        assert_eq!(g.sum_squares(0..5).unwrap(), 4.0 + 16.0 + 3.0);
        assert_eq!(g.sum_squares(2..5).unwrap(), 3.0);
        assert!(
            g.accumulate(1, &a).is_err(),
            "element count mismatch is an error"
        );
        g.zero().unwrap();
        assert_eq!(g.sum_squares(0..5).unwrap(), 0.0);
    }
}
