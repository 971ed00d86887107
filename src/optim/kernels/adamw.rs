//! The AdamW update in place over a flat state (fp32 master weights, fp32 or bf16 moments):
//! the whole owned range at once on the device, or a part at a time on the host
//! ([`AdamWPart`], the offloaded update).

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{bail, CpuStorage, DType, InplaceOp2, Layout, Result};
use half::bf16;
#[cfg(feature = "cuda")]
use model::ops::cuda::flat;
use rayon::prelude::*;

use super::{f32_slice, f32_slice_mut, CHUNK};

/// One AdamW step in place over a flat state of f32 words — the master weights `[n]`, then
/// `exp_avg` and `exp_avg_sq` `[n]` each in `moments` (f32: `3 n` words; bf16: two to a word,
/// `2 n` words) — and gradients `[n]` f32. The update is computed in f32 and the moments are
/// stored rounded to nearest.
pub struct AdamWStep {
    /// Learning rate of this step.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// 1-based step number (bias correction).
    pub step: u64,
    /// Factor applied to every gradient first (global-norm clipping).
    pub grad_scale: f64,
    /// `(start, len, weight_decay)` ranges covering `[0, n)`.
    pub decay: Vec<(usize, usize, f64)>,
    /// Element type of the moments: f32 or bf16.
    pub moments: DType,
}

/// An element type the AdamW moments are kept in: read as f32, stored rounded to nearest.
trait Moment: Copy + Send + Sync + bytemuck::Pod {
    fn get(self) -> f32;
    fn put(x: f32) -> Self;
}

impl Moment for f32 {
    fn get(self) -> f32 {
        self
    }
    fn put(x: f32) -> Self {
        x
    }
}

impl Moment for bf16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// State words per element: one for the master weight and the moments' share.
pub fn state_words(n: usize, moments: DType) -> Result<usize> {
    match moments {
        DType::F32 => Ok(3 * n),
        DType::BF16 => Ok(2 * n),
        d => bail!("adamw: moments of dtype {d:?} (f32 or bf16 are supported)"),
    }
}

/// The step-wide f32 scalars of an AdamW update, shared by the CPU and CUDA kernels.
struct StepScalars {
    b1: f32,
    b2: f32,
    /// `lr / (1 - beta1^step)`.
    step_size: f32,
    /// `1 / sqrt(1 - beta2^step)`.
    inv_sqrt_bc2: f32,
    eps: f32,
    /// Gradient scale.
    gs: f32,
}

impl AdamWStep {
    /// The step's scalars, computed in f64 and rounded to f32.
    fn scalars(&self) -> StepScalars {
        let bc1 = 1.0 - self.beta1.powi(self.step as i32);
        let bc2 = 1.0 - self.beta2.powi(self.step as i32);
        StepScalars {
            b1: self.beta1 as f32,
            b2: self.beta2 as f32,
            step_size: (self.lr / bc1) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            eps: self.eps as f32,
            gs: self.grad_scale as f32,
        }
    }

    /// The decoupled weight-decay factor `1 - lr · wd` of a range.
    fn keep(&self, wd: f64) -> f32 {
        (1.0 - self.lr * wd) as f32
    }

    /// The update of the owned elements `at..at + grad.len()` of `master` `[n]` and the moments
    /// `m`, `v` `[n]` each, from `grad` `[len]`, with the CUDA kernel's f32 operations in its
    /// order (element-wise: a part updated alone is bitwise the whole update's part).
    fn update<M: Moment>(
        &self,
        master: &mut [f32],
        (m, v): (&mut [M], &mut [M]),
        grad: &[f32],
        at: usize,
    ) {
        let StepScalars {
            b1,
            b2,
            step_size,
            inv_sqrt_bc2,
            eps,
            gs,
        } = self.scalars();
        let part = at..at + grad.len();
        for &(start, len, wd) in &self.decay {
            let r = start.max(part.start)..(start + len).min(part.end);
            if r.is_empty() {
                continue;
            }
            let keep = self.keep(wd);
            let g = r.start - at..r.end - at;
            master[r.clone()]
                .par_chunks_mut(CHUNK)
                .zip(m[r.clone()].par_chunks_mut(CHUNK))
                .zip(v[r].par_chunks_mut(CHUNK))
                .zip(grad[g].par_chunks(CHUNK))
                .for_each(|(((p, m), v), g)| {
                    for i in 0..p.len() {
                        let g = g[i] * gs;
                        let mi = b1 * m[i].get() + (1.0 - b1) * g;
                        let vi = b2 * v[i].get() + (1.0 - b2) * g * g;
                        (m[i], v[i]) = (M::put(mi), M::put(vi));
                        let denom = vi.sqrt() * inv_sqrt_bc2 + eps;
                        p[i] = p[i] * keep - step_size * mi / denom;
                    }
                });
        }
    }

    /// Errors unless every decay range lies within `[0, n)`.
    fn check_ranges(&self, n: usize) -> Result<()> {
        for &(start, len, _) in &self.decay {
            if start.checked_add(len).is_none_or(|end| end > n) {
                bail!("adamw: decay range {start}..{start}+{len} exceeds the {n} elements")
            }
        }
        Ok(())
    }
}

impl InplaceOp2 for AdamWStep {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(&self, st: &mut CpuStorage, sl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let grad = f32_slice(g, gl, "adamw gradient")?;
        let n = grad.len();
        AdamWPart { step: self, at: 0 }.cpu_update(st, sl, grad, n)
    }

    /// The same update on CUDA, one launch per run of ranges with equal decay.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        st: &mut CudaStorage,
        sl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        let s = self.scalars();
        let scalars = flat::AdamWScalars {
            beta1: s.b1,
            beta2: s.b2,
            step_size: s.step_size,
            inv_sqrt_bc2: s.inv_sqrt_bc2,
            eps: s.eps,
            grad_scale: s.gs,
        };
        let ranges: Vec<(usize, usize, f32)> = self
            .decay
            .iter()
            .map(|&(start, len, wd)| (start, len, self.keep(wd)))
            .collect();
        flat::adamw(st, sl, g, gl, &scalars, &ranges, self.moments)
    }
}

/// [`AdamWStep`] over a part of the owned elements: the gradients `[len]` of the elements
/// `at..at + len` of a whole state (the offloaded update, a part at a time, on the host).
pub struct AdamWPart<'a> {
    /// The step.
    pub step: &'a AdamWStep,
    /// The first owned element of the part.
    pub at: usize,
}

impl AdamWPart<'_> {
    /// The update of a state of `n` owned elements from the part's `grad`.
    fn cpu_update(&self, st: &mut CpuStorage, sl: &Layout, grad: &[f32], n: usize) -> Result<()> {
        let op = self.step;
        let state = f32_slice_mut(st, sl, "adamw state")?;
        let words = state_words(n, op.moments)?;
        if state.len() != words {
            bail!(
                "adamw: state has {} words, expected {words} for {n} elements with {:?} moments",
                state.len(),
                op.moments
            );
        }
        if self.at.checked_add(grad.len()).is_none_or(|end| end > n) {
            bail!(
                "adamw: a part of {} elements at {} exceeds the {n} owned",
                grad.len(),
                self.at
            );
        }
        op.check_ranges(n)?;
        let (master, rest) = state.split_at_mut(n);
        match op.moments {
            DType::BF16 => {
                let (m, v) = bytemuck::cast_slice_mut::<f32, bf16>(rest).split_at_mut(n);
                op.update(master, (m, v), grad, self.at)
            }
            _ => {
                let (m, v) = rest.split_at_mut(n);
                op.update(master, (m, v), grad, self.at)
            }
        }
        Ok(())
    }
}

impl InplaceOp2 for AdamWPart<'_> {
    fn name(&self) -> &'static str {
        "adamw-part"
    }

    /// `st`: the whole state of `n` owned elements (`3 n` words with f32 moments, `2 n` with
    /// bf16); `g`: the part's gradients.
    fn cpu_fwd(&self, st: &mut CpuStorage, sl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let grad = f32_slice(g, gl, "adamw gradient")?;
        let words = sl.shape().elem_count();
        let n = match self.step.moments {
            DType::BF16 => words / 2,
            _ => words / 3,
        };
        self.cpu_update(st, sl, grad, n)
    }
}
