//! A rank's optimizer over the flat ranges it owns: AdamW for every element
//! (`optimizer.name: adamw`), or Muon for the hidden matrices' elements and AdamW for the rest
//! (`muon`). The owned ranges are cut where a hidden matrix begins or ends; each part keeps its
//! own state over its cuts, and [`Optimizer::master`] puts the master weights back in owned
//! order.

use std::ops::Range;
use std::time::Duration;

use candle_core::{DType, Device, Result, Tensor};
use ckpt::PieceDtype;
use model::ParamSet;
use parallel::comm::local::LocalWorld;
use parallel::dp::{intersect, MatrixGroups, ShardPos, Spread, WholeMatrices};
use parallel::Group;

use super::muon::Muon;
use super::offload::{HostUpdate, Part as OffloadPart};
use super::{copy_owned, AdamW, FlatLayout, GradBuffer};
use crate::recipe::{Offload, OptimizerConfig, OptimizerName};

/// Which part updates a run of owned elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    AdamW,
    Muon,
}

/// A run of owned elements: its part, where it starts in that part's state, its length.
type Run = (Part, usize, usize);

/// The owned ranges cut by part.
#[derive(Debug, Default, PartialEq)]
struct Split {
    adamw: Vec<Range<usize>>,
    muon: Vec<Range<usize>>,
    /// The runs in owned order.
    runs: Vec<Run>,
}

/// Cuts `owned` where a parameter with `hidden[i]` begins or ends (padding goes to AdamW),
/// merging neighbours of one part.
fn split(layout: &FlatLayout, owned: &[Range<usize>], hidden: &[bool]) -> Split {
    let mut cuts: Vec<(Part, Range<usize>)> = Vec::new();
    let mut push = |part: Part, r: Range<usize>| match cuts.last_mut() {
        Some((p, last)) if *p == part && last.end == r.start => last.end = r.end,
        _ if r.is_empty() => {}
        _ => cuts.push((part, r)),
    };
    for r in owned {
        let mut at = r.start;
        for (i, &h) in hidden.iter().enumerate() {
            let cut = intersect(&layout.range(i), r);
            if cut.is_empty() {
                continue;
            }
            push(Part::AdamW, at..cut.start);
            push(if h { Part::Muon } else { Part::AdamW }, cut.clone());
            at = cut.end;
        }
        push(Part::AdamW, at..r.end);
    }
    let mut s = Split::default();
    let mut sizes = [0usize; 2];
    for (part, r) in cuts {
        let (list, size) = match part {
            Part::AdamW => (&mut s.adamw, &mut sizes[0]),
            Part::Muon => (&mut s.muon, &mut sizes[1]),
        };
        s.runs.push((part, *size, r.len()));
        *size += r.len();
        list.push(r);
    }
    s
}

/// The elements of `x` (owned order) in the runs of `part`, back to back.
fn select(x: &Tensor, runs: &[Run], part: Part) -> Result<Tensor> {
    let mut parts = Vec::new();
    let mut at = 0;
    for &(p, _, len) in runs {
        if p == part {
            parts.push(x.narrow(0, at, len)?);
        }
        at += len;
    }
    if parts.is_empty() {
        // Kept off the device: CUDA allocates nothing of size zero.
        return Tensor::zeros(0, DType::F32, &Device::Cpu);
    }
    Tensor::cat(&parts, 0)
}

/// The optimizer of a rank.
pub struct Optimizer {
    owned: Vec<Range<usize>>,
    adamw: AdamW,
    muon: Option<Muon>,
    runs: Vec<Run>,
    /// With `optimizer.offload: cpu`: AdamW's update on the host.
    host: Option<HostUpdate>,
}

impl Optimizer {
    /// The optimizer of the flat ranges `owned` of `layout`: master weights from `master`
    /// (`[Σ len]` f32, ZeRO-3's shards) or else from `params`. With `muon`, the parameters
    /// flagged hidden go to Muon, whose matrices the given [`WholeMatrices`] assembles.
    pub fn new(
        params: &ParamSet,
        layout: &FlatLayout,
        owned: Vec<Range<usize>>,
        cfg: &OptimizerConfig,
        master: Option<Tensor>,
        muon: Option<(WholeMatrices, &[bool])>,
    ) -> Result<Self> {
        let n: usize = owned.iter().map(|r| r.len()).sum();
        let Some((whole, hidden)) = muon else {
            let adamw = match master {
                Some(m) => AdamW::with_masters(params, layout, owned.clone(), m, cfg)?,
                None => AdamW::new(params, layout, owned.clone(), cfg)?,
            };
            let host = match cfg.offload {
                Offload::Cpu => Some(HostUpdate::new(cfg.offload_threads, layout, &owned)?),
                Offload::None => None,
            };
            return Ok(Self {
                owned,
                adamw,
                muon: None,
                runs: vec![(Part::AdamW, 0, n)],
                host,
            });
        };
        if cfg.offload != Offload::None {
            candle_core::bail!("optimizer.offload: cpu offloads AdamW only, not Muon");
        }
        let s = split(layout, &owned, hidden);
        let device = params
            .iter()
            .next()
            .map_or(Device::Cpu, |p| p.device.clone());
        let k: usize = s.muon.iter().map(|r| r.len()).sum();
        let (adamw, muon_master) = match &master {
            Some(m) => {
                let a = select(m, &s.runs, Part::AdamW)?;
                let adamw = AdamW::with_masters(params, layout, s.adamw.clone(), a, cfg)?;
                (adamw, select(m, &s.runs, Part::Muon)?)
            }
            None => {
                let adamw = AdamW::new(params, layout, s.adamw.clone(), cfg)?;
                let m = Tensor::zeros(k, DType::F32, if k == 0 { &Device::Cpu } else { &device })?;
                copy_owned(params, layout, &s.muon, &m)?;
                (adamw, m)
            }
        };
        let mut offsets = Vec::new();
        let mut at = 0;
        for &(p, _, len) in &s.runs {
            if p == Part::Muon {
                offsets.push(at);
            }
            at += len;
        }
        let muon = Muon::new(cfg, s.muon, (n, offsets), &muon_master, (whole, &device))?;
        Ok(Self {
            owned,
            adamw,
            muon: Some(muon),
            runs: s.runs,
            host: None,
        })
    }

    /// The optimizer of a model held whole by one rank (benchmarks, tests): every element
    /// owned, Muon's matrices (`hidden`, with `optimizer.name: muon`) whole where they are.
    pub fn single_rank(
        params: &ParamSet,
        layout: &FlatLayout,
        cfg: &OptimizerConfig,
        hidden: &[bool],
    ) -> Result<Self> {
        let owned: Vec<Range<usize>> = std::iter::once(0..layout.total).collect();
        if cfg.name != OptimizerName::Muon {
            return Self::new(params, layout, owned, cfg, None, None);
        }
        let comm = LocalWorld::new(1, Duration::from_secs(60)).remove(0);
        let one = Group::new(vec![0]);
        let groups = MatrixGroups {
            shard: one.clone(),
            expert_grad: one.clone(),
            tp: one,
        };
        let no_experts = vec![false; hidden.len()];
        let whole = super::muon::exchange(
            comm,
            layout,
            (Spread::Alone, ShardPos::uniform(0, 1)),
            groups,
            (params, hidden, &no_experts),
            &cfg.muon,
        );
        Self::new(params, layout, owned, cfg, None, Some((whole, hidden)))
    }

    /// The flat ranges this optimizer updates.
    pub fn owned(&self) -> &[Range<usize>] {
        &self.owned
    }

    /// AdamW's part.
    pub fn adamw(&self) -> &AdamW {
        &self.adamw
    }

    /// AdamW's part, to restore.
    pub fn adamw_mut(&mut self) -> &mut AdamW {
        &mut self.adamw
    }

    /// Muon's part (`optimizer.name: muon`).
    pub fn muon(&self) -> Option<&Muon> {
        self.muon.as_ref()
    }

    /// Muon's part, to restore.
    pub fn muon_mut(&mut self) -> Option<&mut Muon> {
        self.muon.as_mut()
    }

    /// One update with learning rate `lr`, gradients scaled by `grad_scale` (clipping). With
    /// Muon every rank of the shard and tensor-parallel groups takes part.
    pub fn step(&mut self, grads: &GradBuffer, lr: f64, grad_scale: f64) -> Result<()> {
        self.step_parts(grads, lr, grad_scale, |_, _| Ok(()))
    }

    /// [`Optimizer::step`], handing each updated part of an offloaded state on as it is done:
    /// `ready(part, masters)` with the part's new master weights (host, f32), while the host
    /// updates the next (see `offload.rs`). Without offload, nothing is handed on.
    pub fn step_parts(
        &mut self,
        grads: &GradBuffer,
        lr: f64,
        grad_scale: f64,
        ready: impl FnMut(&OffloadPart, &Tensor) -> Result<()>,
    ) -> Result<()> {
        if let Some(host) = &self.host {
            return host.step(&mut self.adamw, grads, (lr, grad_scale), ready);
        }
        self.adamw.step(grads, lr, grad_scale)?;
        if let Some(m) = &mut self.muon {
            m.step(grads, lr, grad_scale)?;
        }
        Ok(())
    }

    /// Whether [`Optimizer::step_into`] can write the parameters: AdamW alone, beside the
    /// gradients (not offloaded).
    pub fn writes_params(&self) -> bool {
        self.muon.is_none() && self.host.is_none()
    }

    /// [`Optimizer::step`] writing the new master weights into `params` (`[n]` owned elements,
    /// the parameters' flat tensor) as it stores them (see [`AdamW::step_into`]); an error
    /// unless [`Optimizer::writes_params`].
    pub fn step_into(
        &mut self,
        grads: &GradBuffer,
        lr_scale: (f64, f64),
        params: &Tensor,
    ) -> Result<()> {
        if !self.writes_params() {
            candle_core::bail!("only AdamW's update beside the gradients writes the parameters");
        }
        self.adamw.step_into(grads, lr_scale, params)
    }

    /// Whether the state lives in host memory (`optimizer.offload: cpu`).
    pub fn offloaded(&self) -> bool {
        self.host.is_some()
    }

    /// The host threads an offloaded update runs on.
    pub fn offload_threads(&self) -> Option<usize> {
        self.host.as_ref().map(|h| h.threads())
    }

    /// The owned master weights in owned order `[n]`.
    pub fn master(&self) -> Result<Tensor> {
        let Some(muon) = &self.muon else {
            return self.adamw.master();
        };
        let (a, m) = (self.adamw.master()?, muon.master()?);
        let parts = self
            .runs
            .iter()
            .map(|&(p, at, len)| match p {
                Part::AdamW => a.narrow(0, at, len),
                Part::Muon => m.narrow(0, at, len),
            })
            .collect::<Result<Vec<_>>>()?;
        if parts.is_empty() {
            return Tensor::zeros(0, DType::F32, a.device());
        }
        Tensor::cat(&parts, 0)
    }

    /// Bytes of state, as allocated.
    pub fn state_bytes(&self) -> usize {
        self.adamw.state_bytes() + self.muon.as_ref().map_or(0, |m| m.state_bytes())
    }

    /// `Σ x²` over the whole state (f64): non-finite exactly when some value is.
    pub fn state_sum_squares(&self) -> Result<f64> {
        let muon = self
            .muon
            .as_ref()
            .map_or(Ok(0.0), |m| m.state_sum_squares())?;
        Ok(self.adamw.state_sum_squares()? + muon)
    }

    /// Whether the updates since the last call left any value of the state non-finite: AdamW's
    /// updates flag what they store (one word read), Muon's state is summed.
    pub fn updated_nonfinite(&self) -> Result<bool> {
        let adamw = self.adamw.take_nonfinite()?;
        let muon = match &self.muon {
            Some(m) => !m.state_sum_squares()?.is_finite(),
            None => false,
        };
        Ok(adamw || muon)
    }

    /// The type of AdamW's moments, as checkpoints store them.
    pub fn moment_dtype(&self) -> PieceDtype {
        self.adamw.moment_dtype()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_ranges_are_cut_where_hidden_matrices_begin_and_end() {
        // Parameters of 4, 6, 2, 6 elements; the second and fourth hidden; padding to 20.
        let layout = FlatLayout::new(&[4, 6, 2, 6], 1 << 20, 4);
        assert_eq!(layout.total, 20);
        let hidden = [false, true, false, true];
        let whole: Vec<Range<usize>> = std::iter::once(0..20).collect();
        let s = split(&layout, &whole, &hidden);
        assert_eq!(s.adamw, vec![0..4, 10..12, 18..20]);
        assert_eq!(s.muon, vec![4..10, 12..18]);
        let runs: Vec<_> = s.runs.iter().map(|r| (r.0, r.1, r.2)).collect();
        assert_eq!(
            runs,
            vec![
                (Part::AdamW, 0, 4),
                (Part::Muon, 0, 6),
                (Part::AdamW, 4, 2),
                (Part::Muon, 6, 6),
                (Part::AdamW, 6, 2)
            ]
        );
        // A shard cutting through the parameters.
        let s = split(&layout, &[5..11, 15..20], &hidden);
        assert_eq!(s.muon, vec![5..10, 15..18]);
        assert_eq!(s.adamw, vec![10..11, 18..20]);
        let x = Tensor::arange(0f32, 11.0, &candle_core::Device::Cpu).unwrap();
        let m = select(&x, &s.runs, Part::Muon).unwrap();
        assert_eq!(
            m.to_vec1::<f32>().unwrap(),
            vec![0., 1., 2., 3., 4., 6., 7., 8.]
        );
    }
}
