//! `AdamW`: fp32 master weights and moments over flat buffers, decoupled weight decay with a mask,
//! serializable state.

use candle_core::{DType, Device, Result, Tensor};
use model::{ParamKind, ParamSet};

use super::{kernels::AdamWStep, FlatLayout, GradBuffer};
use crate::recipe::OptimizerConfig;

/// The optimizer's complete state, as saved in checkpoints.
#[derive(Debug, Clone)]
pub struct AdamWState {
    /// Steps taken so far.
    pub step: u64,
    /// `[3, total]` f32: master weights, first moments, second moments.
    pub buffers: Tensor,
}

/// AdamW over a `ParamSet`, keeping its own fp32 copy of every parameter.
pub struct AdamW {
    cfg: OptimizerConfig,
    layout: FlatLayout,
    /// `(start, len, weight_decay)` covering the whole flat range.
    decay: Vec<(usize, usize, f64)>,
    step: u64,
    /// `[3 total]` f32: master | exp_avg | exp_avg_sq.
    state: Tensor,
}

impl AdamW {
    /// Fresh state: master weights copied from `params` (as f32), zero moments.
    pub fn new(params: &ParamSet, cfg: &OptimizerConfig, device: &Device) -> Result<Self> {
        let layout = FlatLayout::of(params);
        let masters: Vec<Tensor> = params
            .iter()
            .map(|p| p.var.as_tensor().to_dtype(DType::F32)?.flatten_all())
            .collect::<Result<_>>()?;
        let zeros = Tensor::zeros(2 * layout.total, DType::F32, device)?;
        let state = Tensor::cat(&[Tensor::cat(&masters, 0)?, zeros], 0)?;
        let decay = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let wd = match p.kind {
                    ParamKind::Matrix => cfg.weight_decay,
                    ParamKind::Embedding if cfg.decay_embeddings => cfg.weight_decay,
                    ParamKind::Embedding | ParamKind::Norm => 0.0,
                };
                (layout.offsets[i], layout.numels[i], wd)
            })
            .collect();
        Ok(Self {
            cfg: cfg.clone(),
            layout,
            decay,
            step: 0,
            state,
        })
    }

    /// The flat layout the optimizer expects gradients in.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// Applies one update with learning rate `lr`, scaling gradients by `grad_scale` (clipping),
    /// then writes the new master weights into `params` (cast to their dtype).
    pub fn step(
        &mut self,
        params: &ParamSet,
        grads: &GradBuffer,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        self.step += 1;
        let op = AdamWStep {
            lr,
            beta1: self.cfg.beta1,
            beta2: self.cfg.beta2,
            eps: self.cfg.eps,
            step: self.step,
            grad_scale,
            decay: self.decay.clone(),
        };
        self.state.inplace_op2(grads.flat(), &op)?;
        self.write_params(params)
    }

    /// Copies the master weights into the model's parameters.
    pub fn write_params(&self, params: &ParamSet) -> Result<()> {
        for (i, p) in params.iter().enumerate() {
            let master = self
                .state
                .narrow(0, self.layout.offsets[i], self.layout.numels[i])?;
            p.var
                .set(&master.reshape(p.var.shape())?.to_dtype(p.var.dtype())?)?;
        }
        Ok(())
    }

    /// A copy of the state for checkpointing.
    pub fn state(&self) -> Result<AdamWState> {
        Ok(AdamWState {
            step: self.step,
            buffers: self.state.reshape((3, self.layout.total))?.copy()?,
        })
    }

    /// Restores a saved state (shapes must match this optimizer's parameters).
    pub fn load_state(&mut self, s: &AdamWState) -> Result<()> {
        let expected = (3, self.layout.total);
        if s.buffers.dims() != [expected.0, expected.1] {
            candle_core::bail!(
                "optimizer state has shape {:?}, this model needs {:?}",
                s.buffers.dims(),
                expected
            );
        }
        self.state = s.buffers.to_dtype(DType::F32)?.flatten_all()?.copy()?;
        self.step = s.step;
        Ok(())
    }
}
