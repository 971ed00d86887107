//! Muon (orthogonalised momentum) over the hidden matrices a rank owns, as `torch.optim.Muon`
//! defines it: per step and matrix,
//!
//! ```text
//! buf ← lerp(buf, g, 1 − momentum)
//! u   ← nesterov ? lerp(g, buf, momentum) : buf
//! O   ← NewtonSchulz(u)            on the whole logical matrix
//! W   ← W (1 − lr·wd) − lr·ratio(A, B) · O
//! ```
//!
//! with `ratio = sqrt(max(1, A/B))` (`adjust_lr: original`) or `0.2 sqrt(max(A, B))`
//! (`match_rms_adamw`) for a matrix of shape `[A, B]`. The elementwise parts run on the flat
//! ranges this rank owns; the orthogonalisation needs the whole matrix, which
//! `parallel::dp::WholeMatrices` assembles from tensor-parallel blocks and ZeRO shards and
//! spreads over the shard group. The iteration runs in f32 on the CPU and in bf16 with f32
//! accumulation on a GPU (as the references do).
//!
//! State: fp32 master weights and an fp32 momentum buffer per owned element, `[master |
//! momentum]` in one buffer.

use std::ops::Range;

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use model::ParamSet;
use parallel::dp::{FlatLayout, Matrix, MatrixGroups, ShardPos, Spread, WholeMatrices};
use parallel::tp::Shard;
use parallel::Comm;

use super::kernels::{sum_squares, sum_squares_tensor};
use super::{spans, GradBuffer};
use crate::recipe::{AdjustLr, MuonConfig};
use product::addmm;

/// `torch.lerp(start, end, weight)` with its two-sided formula (f32 weight): `start + w (end −
/// start)` for `|w| < 0.5`, else `end − (end − start)(1 − w)`, as candle ops (the reference of
/// the fused passes, `fused.rs`).
pub fn lerp(start: &Tensor, end: &Tensor, weight: f64) -> Result<Tensor> {
    let w = weight as f32;
    let diff = (end - start)?;
    if w.abs() < 0.5 {
        start + diff.affine(w as f64, 0.0)?
    } else {
        end - diff.affine((1.0 - w) as f64, 0.0)?
    }
}

/// The learning-rate ratio of a matrix of shape `[a, b]`.
pub fn lr_ratio(adjust: AdjustLr, [a, b]: [usize; 2]) -> f64 {
    let (a, b) = (a as f64, b as f64);
    match adjust {
        AdjustLr::Original => (a / b).max(1.0).sqrt(),
        AdjustLr::MatchRmsAdamw => 0.2 * a.max(b).sqrt(),
    }
}

/// The Newton-Schulz orthogonalisation of `g` `[a, b]` in `dtype` (f32, or bf16 whose
/// products accumulate in f32), as `torch.optim.Muon` computes it: a tall matrix is iterated
/// transposed, divided by its Frobenius norm (of `g`, at least `eps`), then `ns_steps` times `A = X Xᵀ`,
/// `B = b A + c A A`, `X = a X + B X`, the last two each one product rounded once
/// ([`product::addmm`]). Returns f32.
pub fn newton_schulz(g: &Tensor, cfg: &MuonConfig, dtype: DType) -> Result<Tensor> {
    let tall = g.dim(0)? > g.dim(1)?;
    finished(&iterate(prepared(g, cfg, dtype)?, cfg)?, tall)
}

/// Most elements of a batch of matrices iterated together (256 MiB in f32): enough for the
/// small matrices that leave a GPU idle alone (a 1B model's 22 k or v projections, 16 of its
/// q), while the iteration's temporaries stay a few batches' size; a larger group of one shape
/// is iterated in several batches.
const BATCH_ELEMENTS: usize = 1 << 26;

/// [`newton_schulz`] of every matrix of `gs`, those of one shape iterated together in batches
/// (`[B, m, n]`: each step's products one strided-batched GEMM on a GPU, where small matrices
/// alone leave it idle; on the CPU each product the unbatched one, so the results are the same
/// bit for bit); in order, f32.
pub fn newton_schulz_batch(gs: &[Tensor], cfg: &MuonConfig, dtype: DType) -> Result<Vec<Tensor>> {
    let mut shapes: std::collections::BTreeMap<(usize, usize), Vec<usize>> = Default::default();
    for (i, g) in gs.iter().enumerate() {
        shapes.entry(g.dims2()?).or_default().push(i);
    }
    let mut out: Vec<Option<Tensor>> = vec![None; gs.len()];
    for ((rows, cols), same) in shapes {
        let per_batch = (BATCH_ELEMENTS / (rows * cols).max(1)).max(1);
        for batch in same.chunks(per_batch) {
            if let [i] = batch {
                out[*i] = Some(newton_schulz(&gs[*i], cfg, dtype)?);
                continue;
            }
            let xs = (batch.iter())
                .map(|&i| prepared(&gs[i], cfg, dtype))
                .collect::<Result<Vec<_>>>()?;
            let x = Tensor::stack(&xs, 0)?; // [B, m, n]
            drop(xs);
            let x = iterate(x, cfg)?;
            for (j, &i) in batch.iter().enumerate() {
                out[i] = Some(finished(&x.get(j)?, rows > cols)?);
            }
        }
    }
    Ok(out.into_iter().flatten().collect())
}

/// `g` in `dtype`, wide (a tall matrix transposed), divided by its Frobenius norm (at least
/// `eps`): the iteration's start `[m, n]`, `m ≤ n`.
fn prepared(g: &Tensor, cfg: &MuonConfig, dtype: DType) -> Result<Tensor> {
    let (rows, cols) = g.dims2()?;
    // ‖g‖ in f64 by the optimizer's two-stage reduction (candle's `sum_all` reduces in one
    // block: 0.5 ms for a 2048 × 5632 matrix on an H100, 84 ms of a 1.1B model's step).
    let g = g.to_dtype(DType::F32)?.contiguous()?;
    let norm = sum_squares_tensor(&g.flatten_all()?, DType::F32)?
        .sqrt()?
        .maximum(cfg.eps)?
        .to_dtype(DType::F32)?
        .to_dtype(dtype)?;
    let mut x = g.to_dtype(dtype)?;
    if rows > cols {
        x = x.t()?.contiguous()?;
    }
    x.broadcast_div(&norm)
}

/// The `ns_steps` quintic steps on `x` `[(B,) m, n]`.
fn iterate(mut x: Tensor, cfg: &MuonConfig) -> Result<Tensor> {
    let [ca, cb, cc] = cfg.ns_coefficients;
    for _ in 0..cfg.ns_steps {
        let gram = x.matmul(&x.t()?)?; // [(B,) m, m]
        let update = addmm(&gram, &gram, &gram, cb, cc)?; // [(B,) m, m]
        x = addmm(&x, &update, &x, ca, 1.0)?; // [(B,) m, n]
    }
    Ok(x)
}

/// An iterated `x` `[m, n]` back in its matrix's orientation, f32.
fn finished(x: &Tensor, tall: bool) -> Result<Tensor> {
    let x = if tall {
        x.t()?.contiguous()?
    } else {
        x.clone()
    };
    x.to_dtype(DType::F32)
}

/// The exchange assembling the hidden matrices (`hidden[i]`) of `params`, laid out by `layout`
/// at `place` (sharded or not, and where) over `groups`; `expert[i]` for a routed expert's
/// matrix sharded over the expert gradient group. Owners are balanced by [`MuonConfig::ns_cost`].
pub fn exchange(
    comm: Arc<dyn Comm>,
    layout: &FlatLayout,
    place: (Spread, ShardPos),
    groups: MatrixGroups,
    (params, hidden, expert): (&ParamSet, &[bool], &[bool]),
    cfg: &MuonConfig,
) -> WholeMatrices {
    let tp = groups.tp.size();
    let matrices = params
        .iter()
        .enumerate()
        .filter(|&(i, _)| hidden[i])
        .map(|(i, p)| Matrix {
            param: i,
            shape: [p.block.shape[0], p.block.shape[1]],
            tp_dim: match p.shard {
                Shard::Dim(d) if tp > 1 => Some(d),
                _ => None,
            },
            expert: expert[i],
        })
        .collect();
    let cfg = cfg.clone();
    WholeMatrices::new(comm, layout.clone(), place, groups, matrices, move |s| {
        cfg.ns_cost(s)
    })
}

/// Muon over the flat ranges of hidden matrices a rank owns.
pub struct Muon {
    cfg: MuonConfig,
    weight_decay: f64,
    /// The flat ranges updated (parts of the rank's owned ranges), ascending.
    owned: Vec<Range<usize>>,
    /// Elements updated.
    k: usize,
    /// Elements of the rank's owned ranges, and where each of `owned` sits among them:
    /// `(offset among all owned, offset here, len)`.
    spread: (usize, Vec<(usize, usize, usize)>),
    /// The element type the iteration runs in.
    compute: DType,
    /// f32: master `[k]`, then the momentum `[k]`.
    state: Tensor,
    whole: WholeMatrices,
}

impl Muon {
    /// Muon on `device` over `owned` (ascending flat ranges of hidden matrices), whose master
    /// weights are `master` (`[Σ len]` f32), with zero momentum; `spread` says where each range
    /// sits among the `n` elements the rank owns (its offset among them), `whole` assembles the
    /// matrices.
    pub fn new(
        cfg: &crate::recipe::OptimizerConfig,
        owned: Vec<Range<usize>>,
        (n, spread): (usize, Vec<usize>),
        master: &Tensor,
        (whole, device): (WholeMatrices, &Device),
    ) -> Result<Self> {
        let k: usize = owned.iter().map(|r| r.len()).sum();
        let words = 2 * k;
        // No hidden matrix here (a stage of only the embedding or the head): nothing to allocate
        // on the device.
        let at = if k == 0 { &Device::Cpu } else { device };
        let state = crate::device::zeros_f32("the Muon state", words, at)?;
        if k > 0 {
            spans::copy_into(&state, 0, &spans::cast(master, DType::F32)?)?;
        }
        let mut at = 0;
        let spread = spread
            .into_iter()
            .zip(&owned)
            .map(|(offset, r)| {
                at += r.len();
                (offset, at - r.len(), r.len())
            })
            .collect();
        Ok(Self {
            cfg: cfg.muon.clone(),
            weight_decay: cfg.weight_decay,
            owned,
            k,
            spread: (n, spread),
            compute: compute_dtype(device),
            state,
            whole,
        })
    }

    /// The flat ranges this part updates.
    pub fn owned(&self) -> &[Range<usize>] {
        &self.owned
    }

    /// One update at learning rate `lr` with gradients scaled by `grad_scale`. Every rank of
    /// the shard and tensor-parallel groups takes part (the matrices are assembled across them).
    /// The element-wise work is three passes over the flat buffers (`fused.rs`).
    pub fn step(&mut self, grads: &GradBuffer, lr: f64, grad_scale: f64) -> Result<()> {
        let k = self.k;
        let (n, device) = (self.spread.0, grads.flat().device().clone());
        let runs = self.runs(grads)?;
        let scale = (grad_scale != 1.0).then_some(grad_scale as f32);
        // The direction among all `n` owned elements, zero outside the hidden matrices. A rank
        // owning no hidden matrix element still takes part in assembling (and, as an owner,
        // orthogonalising) the matrices of its groups.
        let u = crate::device::zeros_f32("Muon's direction", n, &device)?; // [n]
        if k > 0 {
            let mu = self.cfg.momentum;
            let lerp = fused::Lerp::new(1.0 - mu);
            let momentum = fused::Momentum {
                runs: &runs,
                scale,
                lerp,
            };
            self.state.inplace_op2(grads.flat(), &momentum)?; // buf, in the state
            let direction = fused::Direction {
                runs: &runs,
                scale,
                nesterov: self.cfg.nesterov.then(|| fused::Lerp::new(mu)),
            };
            u.inplace_op3(grads.flat(), &self.state, &direction)?;
        }
        let (cfg, compute) = (&self.cfg, self.compute);
        let mut orthogonalise = |ms: &[Tensor]| -> Result<Vec<Tensor>> {
            let os = newton_schulz_batch(ms, cfg, compute)?;
            (os.iter().zip(ms))
                .map(|(o, m)| {
                    // `W += (−lr · ratio) O`, the product rounded once as torch's
                    // `add_(alpha=)` does.
                    let shape = [m.dim(0)?, m.dim(1)?];
                    o.affine(-lr * lr_ratio(cfg.adjust_lr, shape), 0.0)
                })
                .collect()
        };
        let o = self.whole.map(&u, &mut orthogonalise)?; // [n]
        if k == 0 {
            return Ok(());
        }
        let keep = (1.0 - lr * self.weight_decay) as f32;
        let apply = fused::Apply { runs: &runs, keep };
        self.state.inplace_op2(&o.contiguous()?, &apply)
    }

    /// The runs of this part's elements: where their gradients lie in `grads`, where they sit
    /// here and among the rank's owned elements.
    fn runs(&self, grads: &GradBuffer) -> Result<Vec<fused::Run>> {
        (self.owned.iter().zip(&self.spread.1))
            .map(|(r, &(at, here, len))| {
                Ok(fused::Run {
                    grad: grads.local_start(r)?,
                    here,
                    at,
                    len,
                })
            })
            .collect()
    }

    /// The owned master weights `[k]`.
    pub fn master(&self) -> Result<Tensor> {
        self.state.narrow(0, 0, self.k)
    }

    /// Bytes of state, as allocated.
    pub fn state_bytes(&self) -> usize {
        self.state.elem_count() * std::mem::size_of::<f32>()
    }

    /// `Σ x²` over the master weights and the momentum (f64).
    pub fn state_sum_squares(&self) -> Result<f64> {
        sum_squares(&self.state)
    }

    /// A host copy of `kind` (master weights or momentum) at the owned elements `own` (of
    /// `[k]`), read from the state alone: what a checkpoint streams.
    pub fn read(&self, kind: ckpt::Kind, own: std::ops::Range<usize>) -> Result<Vec<f32>> {
        let base = match kind {
            ckpt::Kind::Momentum => self.k,
            _ => 0,
        };
        super::read_f32(&self.state, base + own.start..base + own.end)
    }

    /// Writes `values` of `kind` (master weights or momentum) at the owned elements `own`, in
    /// place: what a resume streams into the state.
    pub fn write(
        &mut self,
        kind: ckpt::Kind,
        own: std::ops::Range<usize>,
        values: &[f32],
    ) -> Result<()> {
        if values.len() != own.len() {
            candle_core::bail!(
                "muon: {} values for the {} owned elements",
                values.len(),
                own.len()
            );
        }
        let base = match kind {
            ckpt::Kind::Momentum => self.k,
            _ => 0,
        };
        super::write_f32(&self.state, base + own.start, values)
    }
}

/// The element type of the iteration on `device`: bf16 on a GPU, f32 on the CPU.
pub fn compute_dtype(device: &Device) -> DType {
    if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    }
}

pub mod fused;
mod product;
#[cfg(test)]
mod tests;
