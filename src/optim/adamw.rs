//! `AdamW`: fp32 master weights and moments over the flat ranges a rank owns, decoupled weight
//! decay with a mask, serializable state.

use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};
use model::{ParamKind, ParamSet};
use parallel::dp::intersect;

use super::{flatten_params, kernels::AdamWStep, FlatLayout, GradBuffer};
use crate::recipe::OptimizerConfig;

/// The optimizer's complete state, as saved in checkpoints.
#[derive(Debug, Clone)]
pub struct AdamWState {
    /// Steps taken so far.
    pub step: u64,
    /// `[3, owned elements]` f32: master weights, first moments, second moments.
    pub buffers: Tensor,
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
    /// `[3 n]` f32: master | exp_avg | exp_avg_sq.
    state: Tensor,
}

impl AdamW {
    /// Fresh state for the flat ranges `owned` of `layout`: master weights copied from `params`
    /// (as f32), zero moments.
    pub fn new(
        params: &ParamSet,
        layout: &FlatLayout,
        owned: Vec<Range<usize>>,
        cfg: &OptimizerConfig,
    ) -> Result<Self> {
        let device = params
            .iter()
            .next()
            .map_or(Device::Cpu, |p| p.device.clone());
        crate::device::check_elements("the flat parameters", layout.total, &device)?;
        let flat = flatten_params(params, layout)?;
        let masters: Vec<Tensor> = owned
            .iter()
            .map(|r| flat.narrow(0, r.start, r.len()))
            .collect::<Result<_>>()?;
        Self::with_masters(params, layout, owned, Tensor::cat(&masters, 0)?, cfg)
    }

    /// Fresh state for the flat ranges `owned` of `layout` whose master weights are `master`
    /// (`[Σ len]` f32, the ranges one after the other), zero moments; `params` say which
    /// elements take weight decay.
    pub fn with_masters(
        params: &ParamSet,
        layout: &FlatLayout,
        owned: Vec<Range<usize>>,
        master: Tensor,
        cfg: &OptimizerConfig,
    ) -> Result<Self> {
        let owned_len: usize = owned.iter().map(|r| r.len()).sum();
        crate::device::check_elements(
            "the AdamW state (master weights and two moments)",
            owned_len.saturating_mul(3),
            master.device(),
        )?;
        if master.elem_count() != owned_len {
            candle_core::bail!(
                "AdamW: {} master weights for {owned_len} owned elements",
                master.elem_count()
            );
        }
        let n = master.elem_count();
        let zeros = Tensor::zeros(2 * n, DType::F32, master.device())?;
        let state = Tensor::cat(&[master.to_dtype(DType::F32)?, zeros], 0)?;
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
        self.state.inplace_op2(&grads.owned(&self.owned)?, &op)
    }

    /// Bytes of state: fp32 master weights and two moments per owned element.
    pub fn state_bytes(&self) -> usize {
        3 * self.n * std::mem::size_of::<f32>()
    }

    /// The owned master weights, back to back `[n]`.
    pub fn master(&self) -> Result<Tensor> {
        self.state.narrow(0, 0, self.n)
    }

    /// `Σ x²` over the whole state — master weights and both moments (f64 accumulation):
    /// non-finite exactly when some value is.
    pub fn state_sum_squares(&self) -> Result<f64> {
        super::kernels::sum_squares(&self.state)
    }

    /// A copy of the state for checkpointing.
    pub fn state(&self) -> Result<AdamWState> {
        Ok(AdamWState {
            step: self.step,
            buffers: self.state.reshape((3, self.n))?.copy()?,
        })
    }

    /// Restores a saved state (shapes must match this optimizer's owned ranges), moving it to
    /// this optimizer's device.
    pub fn load_state(&mut self, s: &AdamWState) -> Result<()> {
        if s.buffers.dims() != [3, self.n] {
            candle_core::bail!(
                "optimizer state has shape {:?}, this rank needs [3, {}]",
                s.buffers.dims(),
                self.n
            );
        }
        // On this optimizer's device, whatever device the saved state is on.
        self.state = s
            .buffers
            .to_dtype(DType::F32)?
            .to_device(self.state.device())?
            .flatten_all()?
            .copy()?;
        self.step = s.step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use model::init::Init;
    use parallel::tp::TensorParallel;

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
            model::ParamSpec {
                name: "w",
                global_shape: &[2, 3],
                kind: ParamKind::Matrix,
                init: Init::Normal { std: 1.0 },
            },
            1,
            &TensorParallel::single(),
            DType::F32,
            &dev,
        )
        .unwrap();
        ps.add(
            model::ParamSpec {
                name: "norm",
                global_shape: &[3],
                kind: ParamKind::Norm,
                init: Init::Constant(1.0),
            },
            1,
            &TensorParallel::single(),
            DType::F32,
            &dev,
        )
        .unwrap();
        let c = cfg();
        let layout = crate::optim::layout_of(&ps, parallel::config::DEFAULT_BUCKET_SIZE, 1);
        let mut opt = AdamW::new(
            &ps,
            &layout,
            parallel::dp::owned_ranges(&layout, false, parallel::dp::ShardPos::uniform(0, 1)),
            &c,
        )
        .unwrap();
        let grads = GradBuffer::new(layout.clone(), &dev).unwrap();

        let mut p: Vec<Vec<f64>> = ps
            .iter()
            .map(|q| {
                q.tensor()
                    .unwrap()
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
            opt.step(&grads, c.lr, scale).unwrap();
            crate::optim::write_params(&ps, &layout, &opt.master().unwrap()).unwrap();
            for (i, wd) in [(0, c.weight_decay), (1, 0.0)] {
                let gs: Vec<f64> = g[i].iter().map(|x| x * scale).collect();
                reference(&mut p[i], &mut m[i], &mut v[i], &gs, &c, wd, t);
                let got = ps
                    .get(i)
                    .tensor()
                    .unwrap()
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
            model::ParamSpec {
                name: "w",
                global_shape: &[4],
                kind: ParamKind::Matrix,
                init: Init::Normal { std: 1.0 },
            },
            2,
            &TensorParallel::single(),
            DType::F32,
            &dev,
        )
        .unwrap();
        let layout = crate::optim::layout_of(&ps, parallel::config::DEFAULT_BUCKET_SIZE, 1);
        let mut a = AdamW::new(
            &ps,
            &layout,
            parallel::dp::owned_ranges(&layout, false, parallel::dp::ShardPos::uniform(0, 1)),
            &cfg(),
        )
        .unwrap();
        let g = GradBuffer::new(layout.clone(), &dev).unwrap();
        g.accumulate(0, &Tensor::new(&[1f32, -2.0, 3.0, 0.5], &dev).unwrap())
            .unwrap();
        a.step(&g, 0.1, 1.0).unwrap();
        let mut b = AdamW::new(
            &ps,
            &layout,
            parallel::dp::owned_ranges(&layout, false, parallel::dp::ShardPos::uniform(0, 1)),
            &cfg(),
        )
        .unwrap();
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
        let e = b.load_state(&bad).unwrap_err().to_string();
        assert!(
            e.contains("optimizer state has shape [3, 5], this rank needs [3, 4]"),
            "{e}"
        );
    }
}
