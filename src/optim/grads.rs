//! `GradBuffer`: where a rank's fp32 gradients accumulate across the micro-batches of a step.
//!
//! - **Whole** (ZeRO stages 0 and 1): one persistent flat buffer `[layout.total]`; a piece's
//!   gradients are added into their parameters' slots.
//! - **Sharded** (stages 2 and 3): the persistent buffer holds only this rank's shards
//!   (`[n_owned]`, owned order). A piece's gradients are added into full-size staging buffers of
//!   the buckets they belong to, which the data-parallel side takes after that piece's backward
//!   ([`GradBuffer::take_staged`]), reduce-scatters and adds into the shards; the staging is then
//!   freed.
//!
//! A whole buffer need not be zeroed at each step's start ([`GradBuffer::overwriting`]): a
//! parameter that receives a gradient in every step takes its first one written over its slot's
//! old values (the weight-gradient GEMM's beta = 0, a copy for other gradients), and only the
//! rest (the padding, routed experts no token may choose) is zeroed.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor};
use parallel::stats::StepStats;

use super::{kernels, FlatLayout};

/// A rank's fp32 gradients (see the module docs).
pub struct GradBuffer {
    /// `[layout.total]` (whole) or `[n_owned]` (sharded).
    flat: Tensor,
    layout: FlatLayout,
    /// Sharded: the owned flat ranges and where each starts in `flat`.
    owned: Option<(Vec<Range<usize>>, Vec<usize>)>,
    /// Sharded: full-size gradients of the buckets a piece's backward touched, by bucket.
    staged: Mutex<BTreeMap<usize, Tensor>>,
    /// Sharded: where the bytes staged at once are reported.
    stats: Option<Arc<StepStats>>,
    /// Whole, [`GradBuffer::overwriting`]: what a step's start leaves for the first gradients
    /// to overwrite.
    fresh: Fresh,
}

/// A whole buffer's step start without a pass over all of it: `stale[i]` while parameter `i`'s
/// slot holds an earlier step's values, to be written over by its first gradient; the spans
/// `zeroed` (everything else) zeroed. Without `stale`, the whole buffer is zeroed.
#[derive(Default)]
struct Fresh {
    /// Per parameter: `Some` for those whose first gradient overwrites the slot.
    stale: Vec<Option<AtomicBool>>,
    /// The flat spans zeroed at a step's start.
    zeroed: Vec<Range<usize>>,
}

impl GradBuffer {
    /// A zeroed whole buffer for `layout`.
    pub fn new(layout: FlatLayout, device: &Device) -> Result<Self> {
        Ok(Self {
            flat: crate::device::zeros_f32("the gradient buffer", layout.total, device)?,
            layout,
            owned: None,
            staged: Mutex::new(BTreeMap::new()),
            stats: None,
            fresh: Fresh::default(),
        })
    }

    /// A zeroed sharded buffer: only the flat ranges `owned` of `layout` are kept; the bytes of
    /// full-size gradients staged at once are reported to `stats`.
    pub fn sharded(
        layout: FlatLayout,
        owned: Vec<Range<usize>>,
        device: &Device,
        stats: Arc<StepStats>,
    ) -> Result<Self> {
        let mut at = Vec::with_capacity(owned.len());
        let mut n = 0;
        for r in &owned {
            at.push(n);
            n += r.len();
        }
        Ok(Self {
            flat: crate::device::zeros_f32("the gradient buffer", n, device)?,
            layout,
            owned: Some((owned, at)),
            staged: Mutex::new(BTreeMap::new()),
            stats: Some(stats),
            fresh: Fresh::default(),
        })
    }

    /// Whether only this rank's shards are kept.
    pub fn is_sharded(&self) -> bool {
        self.owned.is_some()
    }

    /// A whole buffer whose parameters `always[i]` receive a gradient in every step (all but
    /// routed experts): their first gradient of a step is written over the slot instead of
    /// added into a zeroed one, and [`GradBuffer::zero`] zeroes only the rest. A sharded
    /// buffer is returned as it is (its staging starts zeroed, its shards are reduced into).
    pub fn overwriting(mut self, always: &[bool]) -> Result<Self> {
        if self.owned.is_some() {
            return Ok(self);
        }
        if always.len() != self.layout.offsets.len() {
            candle_core::bail!(
                "gradient buffer: {} flags for {} parameters",
                always.len(),
                self.layout.offsets.len()
            );
        }
        let mut kept: Vec<Range<usize>> = (0..always.len())
            .filter(|&i| always[i])
            .map(|i| self.layout.range(i))
            .collect();
        kept.sort_by_key(|r| r.start);
        let mut zeroed = Vec::new();
        let mut at = 0;
        for r in &kept {
            if r.start > at {
                zeroed.push(at..r.start);
            }
            at = at.max(r.end);
        }
        if at < self.layout.total {
            zeroed.push(at..self.layout.total);
        }
        let stale = always.iter().map(|&a| a.then(|| AtomicBool::new(true)));
        self.fresh = Fresh {
            stale: stale.collect(),
            zeroed,
        };
        Ok(self)
    }

    /// Clears all gradients (start of a step): zeroes the buffer, or with
    /// [`GradBuffer::overwriting`] its spans that no first gradient overwrites.
    pub fn zero(&self) -> Result<()> {
        self.staging().clear();
        if self.fresh.stale.is_empty() {
            return super::spans::zero(&self.flat);
        }
        for s in self.fresh.stale.iter().flatten() {
            s.store(true, Ordering::Relaxed);
        }
        for r in &self.fresh.zeroed {
            super::spans::zero(&self.flat.narrow(0, r.start, r.len())?)?;
        }
        Ok(())
    }

    /// Whether parameter `i`'s slot holds an earlier step's values, which its gradient now
    /// being added must overwrite (the flag is cleared).
    fn take_stale(&self, i: usize) -> bool {
        let stale = self.fresh.stale.get(i).and_then(|s| s.as_ref());
        stale.is_some_and(|s| s.swap(false, Ordering::Relaxed))
    }

    /// Bytes of the persistent buffer.
    pub fn bytes(&self) -> usize {
        self.flat.elem_count() * std::mem::size_of::<f32>()
    }

    /// Adds `grad` into parameter `i`'s gradient (sharded: into its bucket's staging buffer).
    pub fn accumulate(&self, i: usize, grad: &Tensor) -> Result<()> {
        let slot = self.slot(i)?;
        match self.take_stale(i) {
            true => kernels::write_into(&slot, grad),
            false => kernels::add_into(&slot, grad),
        }
    }

    /// Adds the weight gradient `gᵀ · x` (`g` `[rows, out]`, `x` `[rows, in]`) into parameter
    /// `i`'s gradient `[out, in]` with one GEMM into the buffer (see
    /// [`kernels::add_product_into`]; the step's first, over the old values, with beta = 0).
    pub fn accumulate_product(&self, i: usize, g: &Tensor, x: &Tensor) -> Result<()> {
        let slot = self.slot(i)?;
        match self.take_stale(i) {
            true => kernels::write_product_into(&slot, g, x),
            false => kernels::add_product_into(&slot, g, x),
        }
    }

    /// [`GradBuffer::accumulate_product`] for a linear with FP8 GEMMs: one FP8 GEMM on CUDA, the
    /// factors' FP8-rounded values multiplied elsewhere.
    pub fn accumulate_fp8_product(
        &self,
        i: usize,
        g: &model::ops::Fp8Operand,
        x: &model::ops::Fp8Operand,
    ) -> Result<()> {
        kernels::add_fp8_product_into(&self.slot(i)?, g, x, self.take_stale(i))
    }

    /// The f32 view parameter `i`'s gradient accumulates into: its slot of the whole buffer, or
    /// of its bucket's staging buffer (made on first use) when sharded.
    fn slot(&self, i: usize) -> Result<Tensor> {
        let r = self.layout.range(i);
        if self.owned.is_none() {
            return self.flat.narrow(0, r.start, r.len());
        }
        let b = self.layout.bucket_of(i);
        let bucket = &self.layout.buckets[b];
        let mut staged = self.staging();
        let full = match staged.get(&b) {
            Some(t) => t.clone(),
            None => {
                let t = Tensor::zeros(bucket.len, DType::F32, self.flat.device())?;
                staged.insert(b, t.clone());
                if let Some(stats) = &self.stats {
                    stats.grads_staged(staged.values().map(|t| t.elem_count() * 4).sum());
                }
                t
            }
        };
        full.narrow(0, r.start - bucket.start, r.len())
    }

    /// Sharded: takes the staged full-size gradients of the buckets touched since the last call,
    /// in bucket order.
    pub fn take_staged(&self) -> Vec<(usize, Tensor)> {
        std::mem::take(&mut *self.staging()).into_iter().collect()
    }

    fn staging(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Tensor>> {
        // A poisoned lock only means another thread panicked mid-update; the map stays usable.
        self.staged.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whole: parameter `i`'s gradient, flat `[numel]`.
    pub fn get(&self, i: usize) -> Result<Tensor> {
        if self.owned.is_some() {
            candle_core::bail!("gradient buffer: a sharded buffer holds no whole gradients");
        }
        self.flat
            .narrow(0, self.layout.offsets[i], self.layout.numels[i])
    }

    /// The persistent buffer: `[layout.total]` (whole) or `[n_owned]` (sharded, owned order).
    pub fn flat(&self) -> &Tensor {
        &self.flat
    }

    /// The layout.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// The gradients of the flat ranges `ranges`, back to back (what an optimizer owning those
    /// ranges updates with). A sharded buffer gives parts of its own shards only.
    pub fn owned(&self, ranges: &[Range<usize>]) -> Result<Tensor> {
        match (&self.owned, ranges) {
            (Some((mine, _)), _) if mine.as_slice() == ranges => return Ok(self.flat.clone()),
            (None, [r]) if r.len() == self.flat.elem_count() => return Ok(self.flat.clone()),
            _ => {}
        }
        let parts = ranges
            .iter()
            .filter(|r| !r.is_empty())
            .map(|r| self.flat.narrow(0, self.local_start(r)?, r.len()))
            .collect::<Result<Vec<_>>>()?;
        if parts.is_empty() {
            return Tensor::zeros(0, DType::F32, self.flat.device());
        }
        Tensor::cat(&parts, 0)
    }

    /// The gradients of the flat range `r`, copied to the host (just them); sharded, `r` must
    /// lie in an owned range.
    pub fn to_host(&self, r: &Range<usize>) -> Result<Vec<f32>> {
        let start = self.local_start(r)?;
        super::read_f32(&self.flat, start..start + r.len())
    }

    /// Where flat range `r` starts in this buffer; sharded, it must lie in an owned range.
    pub fn local_start(&self, r: &Range<usize>) -> Result<usize> {
        match &self.owned {
            None => Ok(r.start),
            Some((owned, at)) => {
                let k = owned
                    .iter()
                    .position(|o| o.start <= r.start && r.end <= o.end)
                    .ok_or_else(|| {
                        candle_core::Error::Msg(format!(
                            "gradient buffer: range {r:?} is not one this rank holds"
                        ))
                    })?;
                Ok(at[k] + r.start - owned[k].start)
            }
        }
    }

    /// `Σ g²` over a flat range (f64 accumulation); sharded, the range must lie in an owned one.
    pub fn sum_squares(&self, r: Range<usize>) -> Result<f64> {
        if r.is_empty() {
            return Ok(0.0);
        }
        let start = self.local_start(&r)?;
        kernels::sum_squares(&self.flat.narrow(0, start, r.len())?)
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
        let e = g.accumulate(1, &a).unwrap_err().to_string();
        assert!(
            e.contains("add-into: gradient has 2 elements, buffer slice 3"),
            "{e}"
        );
        g.zero().unwrap();
        assert_eq!(g.sum_squares(0..5).unwrap(), 0.0);
    }

    /// Overwriting: a step's first gradient (a tensor or a weight-gradient product) is written
    /// over the last step's values, bit for bit what a zeroed buffer would hold; a parameter
    /// that may go without a gradient (a routed expert) and the padding are zeroed, even after
    /// something wrote NaN over the whole buffer.
    #[test]
    fn overwriting_buffers_write_each_first_gradient_and_zero_the_rest() {
        let dev = Device::Cpu;
        // Parameters of 2, 6 and 3 elements in buckets padded to multiples of 4 (16 in all).
        let layout = FlatLayout::new(&[2, 6, 3], 1 << 20, 4);
        assert!(layout.total > 11);
        let plain = GradBuffer::new(layout.clone(), &dev).unwrap();
        let fresh = GradBuffer::new(layout.clone(), &dev)
            .unwrap()
            .overwriting(&[true, true, false])
            .unwrap();
        let g = Tensor::new(&[[0.5f32, -1.25, 2.0], [3.0, 0.1, -0.7]], &dev).unwrap(); // [2, 3]
        let x = Tensor::new(&[[1.5f32, 0.3], [-2.0, 0.9]], &dev).unwrap(); // [2, 2]: gᵀx [3, 2]
        let step = |b: &GradBuffer, k: f32| {
            b.zero().unwrap();
            for m in 0..2 {
                let a = Tensor::new(&[k, 2.0 * k + m as f32], &dev).unwrap();
                b.accumulate(0, &a).unwrap();
                b.accumulate_product(1, &g.affine(k as f64, 0.0).unwrap(), &x)
                    .unwrap();
            }
            if k > 1.0 {
                // The expert-like parameter: a gradient in some steps only.
                b.accumulate(2, &Tensor::new(&[k; 3], &dev).unwrap())
                    .unwrap();
            }
        };
        for k in [1.0f32, 2.0, 3.0, 0.5] {
            step(&plain, k);
            step(&fresh, k);
            let (a, b) = (
                plain.flat().to_vec1::<f32>().unwrap(),
                fresh.flat().to_vec1::<f32>().unwrap(),
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "step of {k}");
            let nan = Tensor::full(f32::NAN, layout.total, &dev).unwrap();
            fresh.flat().slice_set(&nan, 0, 0).unwrap();
        }
        // The flags must cover every parameter.
        assert!(GradBuffer::new(layout, &dev)
            .unwrap()
            .overwriting(&[true])
            .is_err());
    }

    #[test]
    fn sharded_buffers_stage_whole_buckets_and_keep_only_their_shards() {
        // Two buckets ([0], [1, 2]) padded for 2 shards; this rank owns shard 1 of each.
        let layout = FlatLayout::with_buckets(&[3, 2, 1], &[0..1, 1..3], 2);
        assert_eq!(layout.total, 4 + 4);
        let owned = vec![2..4, 6..8];
        let g = GradBuffer::sharded(layout, owned.clone(), &Device::Cpu, Arc::default()).unwrap();
        assert_eq!(g.flat().elem_count(), 4);
        let ones = |n| Tensor::ones(n, DType::F32, &Device::Cpu).unwrap();
        g.accumulate(1, &ones(2)).unwrap();
        g.accumulate(2, &ones(1)).unwrap();
        g.accumulate(2, &ones(1)).unwrap();
        let staged = g.take_staged();
        assert_eq!(staged.len(), 1);
        assert_eq!(staged[0].0, 1);
        assert_eq!(
            staged[0].1.to_vec1::<f32>().unwrap(),
            vec![1.0, 1.0, 2.0, 0.0]
        );
        assert!(g.take_staged().is_empty(), "taken once");
        let e = g.get(0).unwrap_err().to_string();
        assert!(
            e.contains("gradient buffer: a sharded buffer holds no whole gradients"),
            "{e}"
        );
        assert_eq!(g.owned(&owned).unwrap().elem_count(), 4);
        g.flat().slice_set(&ones(4), 0, 0).unwrap();
        assert_eq!(g.sum_squares(6..8).unwrap(), 2.0);
        let e = g.sum_squares(1..3).unwrap_err().to_string();
        assert!(
            e.contains("gradient buffer: range 1..3 is not one this rank holds"),
            "{e}"
        );
    }

    /// Random-ish values in [-1, 1) from a seed (no RNG dependency).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                ((i.wrapping_add(seed).wrapping_mul(2654435761) >> 8) % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn accumulates_weight_gradients_as_one_product() {
        // A [3, 5] weight after a [2] one; rows 0 (no tokens), 7 and 300 (several GEMM panels).
        let layout = FlatLayout::new(&[2, 15], 1 << 20, 1);
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            let g = GradBuffer::new(layout.clone(), &dev).unwrap();
            let mut want = Tensor::zeros((3, 5), DType::F64, &dev).unwrap();
            for (k, rows) in [0usize, 7, 300].into_iter().enumerate() {
                let t = |n, cols, seed| {
                    Tensor::from_vec(values(n * cols, seed), (n, cols), &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                let (gr, x) = (t(rows, 3, 11 * k as u32), t(rows, 5, 7 + k as u32));
                g.accumulate_product(1, &gr, &x).unwrap();
                let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
                want = (want + f64s(&gr).t().unwrap().matmul(&f64s(&x)).unwrap()).unwrap();
            }
            let want = want.flatten_all().unwrap();
            let got = g.get(1).unwrap().to_dtype(DType::F64).unwrap();
            let max = |t: Tensor| t.abs().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
            let err = max((got - &want).unwrap()) / max(want);
            // f32 and f64: f32 rounding of sums of 300 terms. bf16 on the CPU: the product is
            // computed in bf16 and rounded (2⁻⁸ relative) before it is added.
            let tolerance = if dtype == DType::BF16 { 1e-2 } else { 1e-6 };
            assert!(err < tolerance, "{dtype:?}: off by {err:.2e} relative");
            assert_eq!(g.get(0).unwrap().to_vec1::<f32>().unwrap(), vec![0.0; 2]);
        }
        // A range of a wider gradient's columns (rows 8 apart) is read in place, with the
        // bits of its contiguous copy.
        let wide = Tensor::from_vec(values(300 * 8, 5), (300, 8), &dev).unwrap();
        let x = Tensor::from_vec(values(300 * 5, 6), (300, 5), &dev).unwrap();
        let g = wide.narrow(1, 2, 3).unwrap();
        assert!(model::ops::row_strided(g.layout()).is_some() && !g.is_contiguous());
        let (strided, copied) = (
            GradBuffer::new(layout.clone(), &dev).unwrap(),
            GradBuffer::new(layout.clone(), &dev).unwrap(),
        );
        strided.accumulate_product(1, &g, &x).unwrap();
        copied
            .accumulate_product(1, &g.copy().unwrap(), &x)
            .unwrap();
        let bits = |b: &GradBuffer| b.get(1).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bits(&strided), bits(&copied));
        assert!(bits(&strided).iter().any(|&v| v != 0.0));
        // The product must fill the slot exactly.
        let g = GradBuffer::new(layout, &dev).unwrap();
        let ones = |r, c| Tensor::ones((r, c), DType::F32, &dev).unwrap();
        let e = g
            .accumulate_product(1, &ones(4, 3), &ones(4, 4))
            .unwrap_err();
        assert!(e.to_string().contains("do not make the 15 elements"), "{e}");
        // Sharded: the product lands in the bucket's staging buffer.
        let layout = FlatLayout::with_buckets(&[15, 2], &[0..1, 1..2], 2);
        let owned: Vec<_> = layout
            .buckets
            .iter()
            .map(|b| b.start..b.start + b.len / 2)
            .collect();
        let g = GradBuffer::sharded(layout, owned, &dev, Arc::default()).unwrap();
        g.accumulate_product(0, &ones(2, 3), &ones(2, 5)).unwrap();
        let staged = g.take_staged();
        let v = staged[0].1.to_vec1::<f32>().unwrap();
        assert_eq!(&v[..15], &[2.0; 15]);
    }
}
