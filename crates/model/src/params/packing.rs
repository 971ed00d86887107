//! Where parameters lie together: matrices packed back to back ([`ParamSet::pack`]) and read
//! stacked ([`ParamSet::span`], the fused projections' weights), and every parameter packed at
//! a flat layout's offsets ([`ParamSet::pack_at`]) so that the optimizer writes them all in one
//! pass ([`ParamSet::flat_at`]).

use candle_core::{Result, Tensor};

use super::{ParamSet, Slot};
use crate::segment::storage_key;

/// Whether `a` and `b` are views of one storage (each read lock taken and dropped in turn).
pub(super) fn same_storage(a: &Tensor, b: &Tensor) -> bool {
    storage_key(a) == storage_key(b)
}

/// Whether slots `a` and `b` are ranges of one flat tensor (one storage, one view of it).
fn one_base(a: &Slot, b: &Slot) -> bool {
    a.base.layout().start_offset() == b.base.layout().start_offset()
        && a.base.elem_count() == b.base.elem_count()
        && same_storage(&a.base, &b.base)
}

impl ParamSet {
    /// Packs the installed matrices `members` (one dtype, device and column count) back to back
    /// in that order into one new flat tensor, each slot a range of it: their values are
    /// unchanged, and [`ParamSet::span`] of them is a view.
    pub fn pack(&self, members: &[usize]) -> Result<()> {
        self.columns(members)?;
        let parts = members
            .iter()
            .map(|&i| self.get(i).tensor()?.flatten_all())
            .collect::<Result<Vec<_>>>()?;
        let base = Tensor::cat(&parts, 0)?; // [Σ numel]
        let mut offset = 0;
        for &i in members {
            let p = self.get(i);
            p.put(Some(Slot {
                base: base.clone(),
                offset,
            }));
            offset += p.numel();
        }
        Ok(())
    }

    /// The matrices `members` (one column count) stacked in that order, `[Σ rows, cols]`: a
    /// view where their slots lie back to back in one tensor (packed, or the ranges of one
    /// gathered bucket), else a copy.
    pub fn span(&self, members: &[usize]) -> Result<Tensor> {
        let cols = self.columns(members)?;
        let slots = members
            .iter()
            .map(|&i| self.get(i).installed())
            .collect::<Result<Vec<_>>>()?;
        let rows: usize = members.iter().map(|&i| self.get(i).block.shape[0]).sum();
        let follows = |(a, b): (&Slot, &Slot), i: usize| {
            one_base(a, b) && b.offset == a.offset + self.get(i).numel()
        };
        let back_to_back = slots
            .iter()
            .zip(slots.iter().skip(1))
            .zip(members)
            .all(|(pair, &i)| follows(pair, i));
        if back_to_back {
            let first = &slots[0];
            return first
                .base
                .narrow(0, first.offset, rows * cols)?
                .reshape((rows, cols));
        }
        let parts = members
            .iter()
            .map(|&i| self.get(i).tensor())
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, 0)
    }

    /// The column count the matrices `members` share (an error naming the first that differs).
    fn columns(&self, members: &[usize]) -> Result<usize> {
        let Some(&first) = members.first() else {
            candle_core::bail!("stacking no parameters");
        };
        let head = self.get(first);
        let cols = match head.block.shape.as_slice() {
            &[_, c] => c,
            s => candle_core::bail!("{}: a matrix to stack, got shape {s:?}", head.name),
        };
        for &i in members {
            let p = self.get(i);
            let same = p.block.shape.len() == 2 && p.block.shape[1] == cols;
            if !same || p.dtype != head.dtype || !p.device.same_device(&head.device) {
                candle_core::bail!(
                    "{} ({:?}, {:?}) cannot be stacked under {} ({:?}, {:?})",
                    p.name,
                    p.block.shape,
                    p.dtype,
                    head.name,
                    head.block.shape,
                    head.dtype
                );
            }
        }
        Ok(cols)
    }

    /// Packs every parameter into one new flat tensor `[total]`, parameter `i` at element
    /// `offsets[i]` (a flat layout's; the gaps zero): their values are unchanged, and
    /// [`ParamSet::flat_at`] gives the tensor. Groups stay back to back where the offsets keep
    /// them so. Nothing changes for 16-bit parameters on the CPU (see
    /// `Parameter::views_are_cheap`).
    pub fn pack_at(&self, offsets: &[usize], total: usize) -> Result<()> {
        if offsets.len() != self.len() {
            candle_core::bail!("{} offsets for {} parameters", offsets.len(), self.len());
        }
        let Some(first) = self.params.first() else {
            return Ok(());
        };
        if !first.views_are_cheap() {
            return Ok(()); // 16-bit on the CPU: each keeps its own storage
        }
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.sort_by_key(|&i| offsets[i]);
        let (mut parts, mut at) = (Vec::new(), 0);
        let gap = |n: usize| Tensor::zeros(n, first.dtype, &first.device);
        for &i in &order {
            let p = self.get(i);
            if offsets[i] < at || p.dtype != first.dtype || !p.device.same_device(&first.device) {
                candle_core::bail!(
                    "{}: cannot be packed at {} ({:?}; the packing reached {at})",
                    p.name,
                    offsets[i],
                    p.dtype
                );
            }
            if offsets[i] > at {
                parts.push(gap(offsets[i] - at)?);
            }
            parts.push(p.tensor()?.flatten_all()?);
            at = offsets[i] + p.numel();
        }
        if total < at {
            candle_core::bail!("the parameters reach {at}, past the flat size {total}");
        }
        parts.push(gap(total - at)?);
        let base = Tensor::cat(&parts, 0)?; // [total]
        for (i, p) in self.params.iter().enumerate() {
            p.put(Some(Slot {
                base: base.clone(),
                offset: offsets[i],
            }));
        }
        Ok(())
    }

    /// Runs `write` on the flat tensor `[total]` every parameter lies in at `offsets` (see
    /// [`ParamSet::flat_at`]) as [`super::Parameter::set`] writes one parameter: each FP8 operand
    /// kept of the old values is dropped, its lock held across the write. `false`, with nothing
    /// run, when they do not lie so.
    pub fn write_flat(
        &self,
        offsets: &[usize],
        total: usize,
        write: impl FnOnce(&Tensor) -> Result<()>,
    ) -> Result<bool> {
        let mut kept: Vec<_> = self.params.iter().map(|p| p.fp8_kept()).collect();
        let Some(flat) = self.flat_at(offsets, total) else {
            return Ok(false);
        };
        for k in &mut kept {
            **k = None;
        }
        write(&flat)?;
        Ok(true)
    }

    /// The flat tensor `[total]` every parameter lies in at `offsets`, when they were packed so
    /// ([`ParamSet::pack_at`]) and none was installed elsewhere since.
    pub fn flat_at(&self, offsets: &[usize], total: usize) -> Option<Tensor> {
        let slots: Vec<Slot> = self
            .params
            .iter()
            .map(|p| p.installed().ok())
            .collect::<Option<_>>()?;
        let first = slots.first()?;
        let packed = first.base.elem_count() == total
            && first.base.is_contiguous()
            && offsets.len() == slots.len()
            && slots
                .iter()
                .zip(offsets)
                .all(|(s, &o)| s.offset == o && one_base(first, s));
        packed.then(|| first.base.clone())
    }
}
