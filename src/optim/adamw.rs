//! `AdamW`: fp32 master weights and fp32 or bf16 moments (`optimizer.state_dtype`) over the
//! flat ranges a rank owns, decoupled weight decay with a mask, serializable state.
//!
//! The state is one buffer of f32 words, `[master | exp_avg | exp_avg_sq]`, updated by one
//! in-place kernel (candle's in-place ops write a single tensor): with bf16 moments the two
//! moment arrays are packed two values to a word after the master weights, `2 n` words in all
//! instead of `3 n`.

use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};
use ckpt::{Kind, PieceDtype, Values};
use half::bf16;
use model::{ParamKind, ParamSet};
use parallel::dp::intersect;

use super::kernels::{state_words, sum_squares, sum_squares_of, AdamWPart, AdamWStep, NonFinite};
use super::{read_f32, write_f32};
use super::{FlatLayout, GradBuffer};
use crate::recipe::{Offload, OptimizerConfig};

/// The optimizer's complete state in host memory (the tests' view; checkpoints stream it).
#[cfg(test)]
#[derive(Debug, Clone, PartialEq)]
pub struct AdamWState {
    /// Steps taken so far.
    pub step: u64,
    /// fp32 master weights of the owned elements `[n]`.
    pub master: Vec<f32>,
    /// First moments `[n]`, f32 or bf16.
    pub exp_avg: Values,
    /// Second moments `[n]`, f32 or bf16.
    pub exp_avg_sq: Values,
}

/// The checkpoint type of moments of candle dtype `d` (f32 or bf16).
fn piece_dtype(d: DType) -> PieceDtype {
    match d {
        DType::BF16 => PieceDtype::Bf16,
        _ => PieceDtype::F32,
    }
}

/// AdamW over the flat ranges `owned` of a parameter layout, keeping its own fp32 copy of them.
pub struct AdamW {
    cfg: OptimizerConfig,
    owned: Vec<Range<usize>>,
    /// Elements owned.
    n: usize,
    /// `(start, len, weight_decay)` in owned coordinates, covering `[0, n)`.
    decay: Vec<(usize, usize, f64)>,
    step: u64,
    /// Element type of the moments (f32 or bf16).
    moments: DType,
    /// f32 words: master `[n]`, then exp_avg and exp_avg_sq `[n]` each in `moments`.
    state: Tensor,
    /// Set by an update that stored a non-finite value (on the state's device).
    nonfinite: NonFinite,
}

impl AdamW {
    /// Fresh state for the flat ranges `owned` of `layout`: master weights copied from `params`
    /// (as f32), zero moments. The masters are written into the state buffer one parameter
    /// slice at a time, so start-up holds the state and one parameter's f32 copy at most (a
    /// device pool keeps whatever start-up peaked at for the whole run).
    pub fn new(
        params: &ParamSet,
        layout: &FlatLayout,
        owned: Vec<Range<usize>>,
        cfg: &OptimizerConfig,
    ) -> Result<Self> {
        let device = match cfg.offload {
            Offload::Cpu => Device::Cpu,
            Offload::None => params
                .iter()
                .next()
                .map_or(Device::Cpu, |p| p.device.clone()),
        };
        let n: usize = owned.iter().map(|r| r.len()).sum();
        let state = Self::zero_state(n, cfg, &device)?;
        super::copy_owned(params, layout, &owned, &state)?;
        Self::with_state(params, layout, owned, state, cfg)
    }

    /// Fresh state for the flat ranges `owned` of `layout` whose master weights are `master`
    /// (`[Σ len]` f32, the ranges one after the other), zero moments in the configured state
    /// dtype; `params` say which elements take weight decay.
    pub fn with_masters(
        params: &ParamSet,
        layout: &FlatLayout,
        owned: Vec<Range<usize>>,
        master: Tensor,
        cfg: &OptimizerConfig,
    ) -> Result<Self> {
        let owned_len: usize = owned.iter().map(|r| r.len()).sum();
        if master.elem_count() != owned_len {
            candle_core::bail!(
                "AdamW: {} master weights for {owned_len} owned elements",
                master.elem_count()
            );
        }
        let device = match cfg.offload {
            Offload::Cpu => Device::Cpu,
            Offload::None => master.device().clone(),
        };
        let state = Self::zero_state(owned_len, cfg, &device)?;
        if owned_len > 0 {
            let master = super::spans::cast(&master.flatten_all()?, DType::F32)?;
            let master = master.to_device(&device)?;
            super::spans::copy_into(&state, 0, &master)?;
        }
        Self::with_state(params, layout, owned, state, cfg)
    }

    /// A zero state buffer for `n` owned elements in the configured moment dtype (zero words are
    /// zero master weights and zero moments in either dtype).
    fn zero_state(n: usize, cfg: &OptimizerConfig, device: &Device) -> Result<Tensor> {
        let words = state_words(n, cfg.state_dtype.dtype())?;
        if words == 0 {
            // A rank whose owned elements all belong to Muon: no device allocation of size 0.
            return Tensor::zeros(0, DType::F32, &Device::Cpu);
        }
        crate::device::zeros_f32(
            "the AdamW state (master weights and two moments)",
            words,
            device,
        )
    }

    /// The optimizer over `state` (see [`AdamW::zero_state`]) with its master weights written.
    fn with_state(
        params: &ParamSet,
        layout: &FlatLayout,
        owned: Vec<Range<usize>>,
        state: Tensor,
        cfg: &OptimizerConfig,
    ) -> Result<Self> {
        let moments = cfg.state_dtype.dtype();
        let n: usize = owned.iter().map(|r| r.len()).sum();
        let mut decay = Vec::new();
        let mut base = 0;
        for r in &owned {
            let mut covered = r.start;
            for (i, p) in params.iter().enumerate() {
                let cut = intersect(&layout.range(i), r);
                if cut.is_empty() {
                    continue;
                }
                if cut.start > covered {
                    decay.push((base + covered - r.start, cut.start - covered, 0.0));
                    // padding
                }
                let wd = match p.kind {
                    ParamKind::Matrix => cfg.weight_decay,
                    ParamKind::Embedding if cfg.decay_embeddings => cfg.weight_decay,
                    ParamKind::Embedding | ParamKind::Norm => 0.0,
                };
                decay.push((base + cut.start - r.start, cut.len(), wd));
                covered = cut.end;
            }
            if r.end > covered {
                decay.push((base + covered - r.start, r.end - covered, 0.0));
            }
            base += r.len();
        }
        Ok(Self {
            cfg: cfg.clone(),
            owned,
            n,
            decay,
            step: 0,
            moments,
            nonfinite: NonFinite::on(state.device())?,
            state,
        })
    }

    /// The flat ranges this optimizer updates.
    pub fn owned(&self) -> &[Range<usize>] {
        &self.owned
    }

    /// Applies one update with learning rate `lr`, scaling gradients by `grad_scale` (clipping).
    /// The new master weights are in [`AdamW::master`].
    pub fn step(&mut self, grads: &GradBuffer, lr: f64, grad_scale: f64) -> Result<()> {
        match self.begin(lr, grad_scale) {
            Some(op) => self.state.inplace_op2(&grads.owned(&self.owned)?, &op),
            None => Ok(()),
        }
    }

    /// [`AdamW::step`], then the new master weights written into `params` (`[n]`, the
    /// parameters' flat tensor over the owned elements) rounded to its dtype: on CUDA with bf16
    /// parameters by the update kernel itself as it stores them (one pass fewer over the
    /// masters), elsewhere by [`super::kernels::cast_into`] after it (the same values).
    pub fn step_into(
        &mut self,
        grads: &GradBuffer,
        (lr, grad_scale): (f64, f64),
        params: &Tensor,
    ) -> Result<()> {
        if params.elem_count() != self.n || !params.is_contiguous() {
            candle_core::bail!(
                "adamw: parameters of {:?} to write for {} owned elements",
                params.layout(),
                self.n
            );
        }
        let Some(mut op) = self.begin(lr, grad_scale) else {
            return Ok(());
        };
        let fused = self.state.device().is_cuda()
            && params.dtype() == DType::BF16
            && params.device().same_device(self.state.device());
        if fused {
            op.params = Some(params.clone());
            return self.state.inplace_op2(&grads.owned(&self.owned)?, &op);
        }
        self.state.inplace_op2(&grads.owned(&self.owned)?, &op)?;
        super::kernels::cast_into(params, &self.master()?.to_device(params.device())?)
    }

    /// Counts one update and returns its kernel for [`AdamW::apply_part`] (`None` when the rank
    /// owns nothing).
    pub fn begin(&mut self, lr: f64, grad_scale: f64) -> Option<AdamWStep> {
        self.step += 1;
        (self.n > 0).then(|| AdamWStep {
            lr,
            beta1: self.cfg.beta1,
            beta2: self.cfg.beta2,
            eps: self.cfg.eps,
            step: self.step,
            grad_scale,
            decay: self.decay.clone(),
            moments: self.moments,
            nonfinite: self.nonfinite.clone(),
            params: None,
        })
    }

    /// Whether an update since the last call stored a non-finite master weight or moment (every
    /// update rewrites every owned value, so the state is finite exactly when none did); one
    /// word read instead of a pass over the state.
    pub fn take_nonfinite(&self) -> Result<bool> {
        self.nonfinite.take()
    }

    /// Applies the update `op` (of [`AdamW::begin`]) to the owned elements `at..at + len` from
    /// their gradients `grad` `[len]` (f32, on the state's device, the host): the offloaded
    /// update, a part at a time. The parts of one step may come in any order, each once.
    pub fn apply_part(&self, op: &AdamWStep, at: usize, grad: &Tensor) -> Result<()> {
        self.state.inplace_op2(grad, &AdamWPart { step: op, at })
    }

    /// The device the state lives on (the host when offloaded).
    pub fn device(&self) -> &Device {
        self.state.device()
    }

    /// Bytes of state, as allocated: an fp32 master weight and two moments in the state dtype
    /// per owned element.
    pub fn state_bytes(&self) -> usize {
        self.state.elem_count() * std::mem::size_of::<f32>()
    }

    /// The owned master weights, back to back `[n]`.
    pub fn master(&self) -> Result<Tensor> {
        self.state.narrow(0, 0, self.n)
    }

    /// `Σ x²` over the whole state — master weights and both moments (f64 accumulation):
    /// non-finite exactly when some value is.
    pub fn state_sum_squares(&self) -> Result<f64> {
        if self.moments == DType::F32 {
            return sum_squares(&self.state); // one pass, as every word is an f32 value
        }
        let words = self.state.elem_count();
        let moments = self.state.narrow(0, self.n, words - self.n)?;
        Ok(sum_squares(&self.master()?)? + sum_squares_of(&moments, self.moments)?)
    }

    /// A host copy of `kind` (master weights or a moment, the moment in the state dtype) at the
    /// owned elements `own` (of `[n]`), read from the state alone: what a checkpoint streams.
    pub fn read(&self, kind: Kind, own: Range<usize>) -> Result<Values> {
        let n = self.n;
        let at = |base: usize| base + own.start..base + own.end;
        let moment = match kind {
            Kind::ExpAvg => 0,
            Kind::ExpAvgSq => 1,
            _ => return Ok(Values::F32(read_f32(&self.state, own)?)),
        };
        if self.moments != DType::BF16 {
            return Ok(Values::F32(read_f32(&self.state, at(n + moment * n))?));
        }
        // The n words after the master weights hold the 2 n bf16 moments: read the words that
        // cover the range and cut it out.
        let (first, last) = (moment * n + own.start, moment * n + own.end);
        let words = read_f32(&self.state, n + first / 2..n + last.div_ceil(2))?;
        let halves = bytemuck::cast_slice::<f32, bf16>(&words);
        Ok(Values::Bf16(
            halves[first % 2..first % 2 + own.len()].to_vec(),
        ))
    }

    /// Writes `values` of `kind` (master weights or a moment, in either dtype: converted to the
    /// state's, f32 to bf16 rounding to nearest) at the owned elements `own`, in place: what a
    /// resume streams into the state, one piece at a time.
    pub fn write(&mut self, kind: Kind, own: Range<usize>, values: &Values) -> Result<()> {
        if values.len() != own.len() {
            candle_core::bail!(
                "adamw: {} values for the {} owned elements {own:?}",
                values.len(),
                own.len()
            );
        }
        let n = self.n;
        let moment = match kind {
            Kind::ExpAvg => 0,
            Kind::ExpAvgSq => 1,
            _ => return write_f32(&self.state, own.start, &values.to_f32()),
        };
        if self.moments != DType::BF16 {
            return write_f32(&self.state, n + moment * n + own.start, &values.to_f32());
        }
        // The bf16 moments share f32 words: the words covering the range are read, their halves
        // replaced, and written back.
        let (first, last) = (moment * n + own.start, moment * n + own.end);
        let words = n + first / 2..n + last.div_ceil(2);
        let mut held = read_f32(&self.state, words.clone())?;
        let halves = bytemuck::cast_slice_mut::<f32, bf16>(&mut held);
        if let Values::Bf16(v) = values.to_dtype(PieceDtype::Bf16) {
            halves[first % 2..first % 2 + own.len()].copy_from_slice(&v);
        }
        write_f32(&self.state, words.start, &held)
    }

    /// Sets the count of updates taken (a resume's).
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// A host copy of the whole state, the moments in the state dtype (the tests' view of it:
    /// checkpoints move it a range at a time, [`AdamW::read`]).
    #[cfg(test)]
    pub fn state(&self) -> Result<AdamWState> {
        let all = 0..self.n;
        Ok(AdamWState {
            step: self.step,
            master: self.read(Kind::Master, all.clone())?.to_f32(),
            exp_avg: self.read(Kind::ExpAvg, all.clone())?,
            exp_avg_sq: self.read(Kind::ExpAvgSq, all)?,
        })
    }

    /// Restores a whole state (lengths must match this optimizer's owned ranges), its moments
    /// converted to the state dtype (f32 to bf16 rounds to nearest, bf16 to f32 is exact),
    /// through [`AdamW::write`] as a resume does.
    #[cfg(test)]
    pub fn load_state(&mut self, s: &AdamWState) -> Result<()> {
        let lens = [s.master.len(), s.exp_avg.len(), s.exp_avg_sq.len()];
        if lens != [self.n; 3] {
            candle_core::bail!(
                "optimizer state has {lens:?} master weights and moments, this rank needs {} of each",
                self.n
            );
        }
        let all = 0..self.n;
        self.write(Kind::Master, all.clone(), &Values::F32(s.master.clone()))?;
        self.write(Kind::ExpAvg, all.clone(), &s.exp_avg)?;
        self.write(Kind::ExpAvgSq, all, &s.exp_avg_sq)?;
        self.step = s.step;
        Ok(())
    }

    /// The type of the moments, as checkpoints store them.
    pub fn moment_dtype(&self) -> PieceDtype {
        piece_dtype(self.moments)
    }
}

#[cfg(test)]
mod tests;
