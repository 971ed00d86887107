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

#[cfg(test)]
mod tests {
    use super::*;
    use model::init::Init;

    fn cfg() -> OptimizerConfig {
        OptimizerConfig {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.5,
            decay_embeddings: false,
        }
    }

    /// PyTorch's AdamW in f64 for one tensor.
    fn reference(
        p: &mut [f64],
        m: &mut [f64],
        v: &mut [f64],
        g: &[f64],
        c: &OptimizerConfig,
        wd: f64,
        t: i32,
    ) {
        for i in 0..p.len() {
            p[i] *= 1.0 - c.lr * wd;
            m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g[i];
            v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * g[i] * g[i];
            let mh = m[i] / (1.0 - c.beta1.powi(t));
            let vh = v[i] / (1.0 - c.beta2.powi(t));
            p[i] -= c.lr * mh / (vh.sqrt() + c.eps);
        }
    }

    #[test]
    fn matches_reference_adamw_with_decay_mask_and_grad_scale() {
        let dev = Device::Cpu;
        let mut ps = ParamSet::default();
        ps.add(
            "w",
            &[2, 3],
            ParamKind::Matrix,
            Init::Normal { std: 1.0 },
            1,
            DType::F32,
            &dev,
        )
        .unwrap();
        ps.add(
            "norm",
            &[3],
            ParamKind::Norm,
            Init::Constant(1.0),
            1,
            DType::F32,
            &dev,
        )
        .unwrap();
        let c = cfg();
        let mut opt = AdamW::new(&ps, &c, &dev).unwrap();
        let grads = GradBuffer::new(FlatLayout::of(&ps), &dev).unwrap();

        let mut p: Vec<Vec<f64>> = ps
            .iter()
            .map(|q| {
                q.var
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|&x| x as f64)
                    .collect()
            })
            .collect();
        let mut m = vec![vec![0.0; 6], vec![0.0; 3]];
        let mut v = m.clone();
        for t in 1..=3 {
            let g: Vec<Vec<f64>> = vec![
                (0..6).map(|i| (i as f64 - 2.5) * 0.1 * t as f64).collect(),
                (0..3).map(|i| 0.3 - i as f64 * 0.2).collect(),
            ];
            grads.zero().unwrap();
            for (i, gi) in g.iter().enumerate() {
                let gt = Tensor::from_vec(
                    gi.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                    gi.len(),
                    &dev,
                )
                .unwrap();
                grads.accumulate(i, &gt).unwrap();
            }
            let scale = 0.5;
            opt.step(&ps, &grads, c.lr, scale).unwrap();
            for (i, wd) in [(0, c.weight_decay), (1, 0.0)] {
                let gs: Vec<f64> = g[i].iter().map(|x| x * scale).collect();
                reference(&mut p[i], &mut m[i], &mut v[i], &gs, &c, wd, t);
                let got = ps
                    .get(i)
                    .var
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                for (a, b) in got.iter().zip(&p[i]) {
                    assert!(
                        (*a as f64 - b).abs() < 1e-5,
                        "param {i} step {t}: {a} vs {b}"
                    );
                }
            }
        }
        let st = opt.state().unwrap();
        assert_eq!((st.step, st.buffers.dims().to_vec()), (3, vec![3, 9]));
    }

    #[test]
    fn state_round_trips() {
        let dev = Device::Cpu;
        let mut ps = ParamSet::default();
        ps.add(
            "w",
            &[4],
            ParamKind::Matrix,
            Init::Normal { std: 1.0 },
            2,
            DType::F32,
            &dev,
        )
        .unwrap();
        let mut a = AdamW::new(&ps, &cfg(), &dev).unwrap();
        let g = GradBuffer::new(FlatLayout::of(&ps), &dev).unwrap();
        g.accumulate(0, &Tensor::new(&[1f32, -2.0, 3.0, 0.5], &dev).unwrap())
            .unwrap();
        a.step(&ps, &g, 0.1, 1.0).unwrap();
        let mut b = AdamW::new(&ps, &cfg(), &dev).unwrap();
        b.load_state(&a.state().unwrap()).unwrap();
        let (sa, sb) = (a.state().unwrap(), b.state().unwrap());
        assert_eq!(sa.step, sb.step);
        assert_eq!(
            sa.buffers.to_vec2::<f32>().unwrap(),
            sb.buffers.to_vec2::<f32>().unwrap()
        );
        let bad = AdamWState {
            step: 1,
            buffers: Tensor::zeros((3, 5), DType::F32, &dev).unwrap(),
        };
        assert!(b.load_state(&bad).is_err());
    }
}
