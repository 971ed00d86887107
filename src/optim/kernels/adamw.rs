//! The AdamW update in place over a flat state (fp32 master weights, fp32 or bf16 moments):
//! the whole owned range at once on the device, or a part at a time on the host
//! ([`AdamWPart`], the offloaded update). The update flags a stored value that is not finite
//! ([`NonFinite`]), so the check after a step reads one word instead of the whole state; on
//! CUDA it can also write the bf16 parameters as it stores the masters ([`AdamWStep::params`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{bail, CpuStorage, DType, Device, InplaceOp2, Layout, Result, Tensor};
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
    /// Where the update reports a non-finite stored value.
    pub nonfinite: NonFinite,
    /// Where the CUDA update also writes the new master weights rounded to bf16 (`[n]`, the
    /// parameters' flat tensor), in the same pass; `None` on the CPU, which casts after the
    /// update instead ([`super::cast_into`]).
    pub params: Option<Tensor>,
}

/// Where an AdamW update reports that it stored a value that is not finite (a master weight or
/// a moment): a flag on the host for the CPU update (whole, or a part at a time), a `u32` word
/// on the state's CUDA device for the kernel. Clones share the flag.
#[derive(Debug, Clone)]
pub enum NonFinite {
    /// Set by the CPU update.
    Host(Arc<AtomicBool>),
    /// `[1]` u32 on the device, set to 1 by the CUDA kernel.
    Device(Tensor),
}

impl NonFinite {
    /// A clear flag for an update on `device`.
    pub fn on(device: &Device) -> Result<Self> {
        Ok(match device.is_cuda() {
            true => NonFinite::Device(Tensor::zeros(1, DType::U32, device)?),
            false => NonFinite::Host(Arc::default()),
        })
    }

    /// Whether an update stored a non-finite value since the last call; clears the flag. On
    /// CUDA this reads one word, once the device's queued work is done.
    pub fn take(&self) -> Result<bool> {
        match self {
            NonFinite::Host(flag) => Ok(flag.swap(false, Ordering::Relaxed)),
            NonFinite::Device(word) => {
                let set = word.to_vec1::<u32>()?[0] != 0;
                if set {
                    word.zero_set()?;
                }
                Ok(set)
            }
        }
    }

    /// The host flag, for the CPU update (an error for a device flag).
    fn host(&self) -> Result<&AtomicBool> {
        match self {
            NonFinite::Host(flag) => Ok(flag),
            NonFinite::Device(_) => bail!("adamw: a CPU update given a device's non-finite flag"),
        }
    }
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
    ) -> Result<()> {
        let nonfinite = self.nonfinite.host()?;
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
                    let mut finite = true;
                    for i in 0..p.len() {
                        let g = g[i] * gs;
                        let mi = b1 * m[i].get() + (1.0 - b1) * g;
                        let vi = b2 * v[i].get() + (1.0 - b2) * g * g;
                        (m[i], v[i]) = (M::put(mi), M::put(vi));
                        let denom = vi.sqrt() * inv_sqrt_bc2 + eps;
                        p[i] = p[i] * keep - step_size * mi / denom;
                        finite &=
                            p[i].is_finite() & m[i].get().is_finite() & v[i].get().is_finite();
                    }
                    if !finite {
                        nonfinite.store(true, Ordering::Relaxed);
                    }
                });
        }
        Ok(())
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
        if self.params.is_some() {
            bail!("adamw: the CPU update writes no parameters (cast them after it)");
        }
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
        let NonFinite::Device(word) = &self.nonfinite else {
            bail!("adamw: a CUDA update given a host's non-finite flag");
        };
        let (flag, fl) = word.storage_and_layout();
        let candle_core::Storage::Cuda(flag) = &*flag else {
            bail!("adamw: the non-finite flag is not on the CUDA device of the state");
        };
        let held = self.params.as_ref().map(|p| p.storage_and_layout());
        let params = match &held {
            Some((storage, l)) => match &**storage {
                candle_core::Storage::Cuda(p) => Some((p, *l)),
                _ => bail!("adamw: the parameters are not on the CUDA device of the state"),
            },
            None => None,
        };
        let side = ((flag, fl), params);
        flat::adamw(st, sl, g, gl, &scalars, &ranges, self.moments, side)
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
