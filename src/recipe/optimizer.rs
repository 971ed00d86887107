//! The recipe's `optimizer:` section: AdamW with decoupled weight decay, or Muon for the hidden
//! matrices, the element type of AdamW's moments, where its state lives (`offload`); and the
//! section's checks.

use serde::{Deserialize, Serialize};

use super::{LrCurve, Recipe};

/// `optimizer:` — AdamW with decoupled weight decay, or Muon for the hidden matrices.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Peak learning rate (reached at the end of warmup).
    pub lr: f64,
    /// First-moment decay.
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// Second-moment decay.
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// Denominator epsilon.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Decoupled weight decay applied to projection matrices (never to norm gains).
    #[serde(default = "default_wd")]
    pub weight_decay: f64,
    /// Also decay the token embedding (and a tied output projection).
    #[serde(default)]
    pub decay_embeddings: bool,
    /// Element type of the two AdamW moments (master weights stay fp32 and the update is
    /// computed in fp32 either way): `bf16` halves their memory.
    #[serde(default)]
    pub state_dtype: StateDtype,
    /// `adamw` (every parameter) or `muon` (the attention and MLP/expert projections; AdamW for
    /// the embedding, the output matrix, norms and routers).
    #[serde(default)]
    pub name: OptimizerName,
    /// Muon's settings (used when `name: muon`).
    #[serde(default)]
    pub muon: MuonConfig,
    /// Where AdamW's master weights and moments live: `none` (the training device) or `cpu`
    /// (host memory, updated on the host's cores, as ZeRO-Offload does).
    #[serde(default)]
    pub offload: Offload,
    /// Host threads of the offloaded update; 0: the machine's cores shared by its ranks.
    #[serde(default)]
    pub offload_threads: usize,
}

/// `optimizer.offload`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    /// The state on the training device.
    #[default]
    None,
    /// The state in host memory: gradients streamed to the host, the update on its cores, the
    /// parameters streamed back.
    Cpu,
}

impl std::fmt::Display for Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Offload::None => "none",
            Offload::Cpu => "cpu",
        })
    }
}

/// `optimizer.name`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerName {
    /// AdamW for every parameter.
    #[default]
    AdamW,
    /// Muon for the hidden projection matrices, AdamW for the rest.
    Muon,
}

impl std::fmt::Display for OptimizerName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OptimizerName::AdamW => "adamw",
            OptimizerName::Muon => "muon",
        })
    }
}

/// `optimizer.muon:` — the meanings and defaults of `torch.optim.Muon`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MuonConfig {
    /// Momentum: `buf ← buf + (1 − momentum)(g − buf)`.
    #[serde(default = "default_muon_momentum")]
    pub momentum: f64,
    /// Orthogonalise `g + momentum (buf − g)` instead of `buf`.
    #[serde(default = "default_true")]
    pub nesterov: bool,
    /// Newton-Schulz iterations.
    #[serde(default = "default_ns_steps")]
    pub ns_steps: usize,
    /// The quintic iteration's `(a, b, c)`: `X ← a X + (b A + c A²) X`, `A = X Xᵀ`.
    #[serde(default = "default_ns_coefficients")]
    pub ns_coefficients: [f64; 3],
    /// Floor of the Frobenius norm the update is divided by before iterating.
    #[serde(default = "default_muon_eps")]
    pub eps: f64,
    /// How the learning rate is scaled by a matrix's shape `[A, B]`.
    #[serde(default)]
    pub adjust_lr: AdjustLr,
}

/// `optimizer.muon.adjust_lr`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdjustLr {
    /// `lr · sqrt(max(1, A / B))` (Keller Jordan's Muon).
    #[default]
    Original,
    /// `lr · 0.2 · sqrt(max(A, B))`: the update's RMS matches AdamW's (Moonshot's Muon).
    MatchRmsAdamw,
}

impl MuonConfig {
    /// Multiply-adds of the Newton-Schulz iteration on a matrix of shape `[a, b]` (what Muon's
    /// owners are balanced by, and what the planner prices): per step `X Xᵀ`, `A A` and `B X`
    /// on the wide orientation.
    pub fn ns_cost(&self, [a, b]: [usize; 2]) -> f64 {
        let (m, n) = (a.min(b) as f64, a.max(b) as f64);
        self.ns_steps as f64 * (2.0 * m * m * n + m * m * m)
    }
}

impl Default for MuonConfig {
    fn default() -> Self {
        Self {
            momentum: default_muon_momentum(),
            nesterov: true,
            ns_steps: default_ns_steps(),
            ns_coefficients: default_ns_coefficients(),
            eps: default_muon_eps(),
            adjust_lr: AdjustLr::Original,
        }
    }
}

fn default_muon_momentum() -> f64 {
    0.95
}
pub(super) fn default_true() -> bool {
    true
}
fn default_ns_steps() -> usize {
    5
}
fn default_ns_coefficients() -> [f64; 3] {
    [3.4445, -4.7750, 2.0315]
}
fn default_muon_eps() -> f64 {
    1e-7
}

/// Element type of the AdamW moments (`optimizer.state_dtype`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StateDtype {
    /// 32-bit floats, as PyTorch's AdamW keeps them.
    #[default]
    #[serde(alias = "f32")]
    Fp32,
    /// bfloat16, rounded to nearest from the fp32 values each update computes: 4 bytes of
    /// moments per element instead of 8.
    Bf16,
}

impl StateDtype {
    /// The tensor dtype of the moments.
    pub fn dtype(self) -> candle_core::DType {
        match self {
            StateDtype::Fp32 => candle_core::DType::F32,
            StateDtype::Bf16 => candle_core::DType::BF16,
        }
    }
}

impl std::fmt::Display for StateDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StateDtype::Fp32 => "fp32",
            StateDtype::Bf16 => "bf16",
        })
    }
}

fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.95
}
fn default_eps() -> f64 {
    1e-8
}
fn default_wd() -> f64 {
    0.1
}

impl Recipe {
    /// The `optimizer:` section's problems, and its learning rate against the schedule's.
    pub(super) fn check_optimizer(&self, p: &mut Vec<String>) {
        let (o, s) = (&self.optimizer, &self.schedule);
        if !(o.lr > 0.0 && o.lr <= f32::MAX as f64) {
            p.push(format!(
                "optimizer.lr ({}) must be positive and finite as an f32 (at most {:e})",
                o.lr,
                f32::MAX
            ));
        }
        for (field, b) in [("beta1", o.beta1), ("beta2", o.beta2)] {
            if !(0.0..1.0).contains(&b) {
                p.push(format!("optimizer.{field} ({b}) must be in [0, 1)"));
            }
        }
        if o.eps.is_nan() || o.eps <= 0.0 {
            p.push(format!("optimizer.eps ({}) must be positive", o.eps));
        }
        if o.weight_decay.is_nan() || o.weight_decay < 0.0 {
            p.push(format!(
                "optimizer.weight_decay ({}) must be non-negative",
                o.weight_decay
            ));
        }
        if o.offload == Offload::Cpu && o.name == OptimizerName::Muon {
            p.push(
                "optimizer.offload: cpu updates AdamW's state on the host; Muon's \
                 Newton-Schulz iteration runs on the GPU and is not offloaded (use \
                 optimizer.name: adamw, or optimizer.offload: none)"
                    .to_string(),
            );
        }
        if o.offload_threads > 4096 {
            p.push(format!(
                "optimizer.offload_threads ({}) must be at most 4096 (0: the machine's cores \
                 shared by its ranks)",
                o.offload_threads
            ));
        }
        if o.name == OptimizerName::Muon {
            let m = &o.muon;
            if !(0.0..1.0).contains(&m.momentum) {
                p.push(format!(
                    "optimizer.muon.momentum ({}) must be in [0, 1)",
                    m.momentum
                ));
            }
            if !(1..100).contains(&m.ns_steps) {
                p.push(format!(
                    "optimizer.muon.ns_steps ({}) must be in 1..=99",
                    m.ns_steps
                ));
            }
            if m.ns_coefficients.iter().any(|c| !c.is_finite()) {
                p.push(format!(
                    "optimizer.muon.ns_coefficients ({:?}) must be finite",
                    m.ns_coefficients
                ));
            } else if let Some((x, y)) = ns_growth(m.ns_coefficients) {
                p.push(format!(
                    "optimizer.muon.ns_coefficients ({:?}): each step maps a singular value x in \
                     [0, 1] to a·x + b·x³ + c·x⁵, which gives {y:.3e} at x = {x:.3}; the iteration \
                     diverges past |4| (the default, Keller Jordan's (3.4445, -4.775, 2.0315), \
                     stays within 1.2)",
                    m.ns_coefficients
                ));
            }
            if m.eps.is_nan() || m.eps <= 0.0 {
                p.push(format!("optimizer.muon.eps ({}) must be positive", m.eps));
            }
        }
        if !(s.min_lr >= 0.0 && s.min_lr <= o.lr) {
            p.push(format!(
                "schedule.min_lr ({}) must be in [0, optimizer.lr = {}]",
                s.min_lr, o.lr
            ));
        }
        if s.kind == LrCurve::Wsd && !(s.decay_fraction > 0.0 && s.decay_fraction <= 1.0) {
            p.push(format!(
                "schedule.decay_fraction ({}) must be in (0, 1]",
                s.decay_fraction
            ));
        }
    }
}

/// Where the Newton–Schulz step `a·x + b·x³ + c·x⁵` takes a singular value `x` of `[0, 1]` (the
/// orthogonalised matrix is first scaled to a spectral norm of at most 1) past 4 in magnitude,
/// from which the iteration diverges: the first such `x` of 1001 and its image.
pub(super) fn ns_growth([a, b, c]: [f64; 3]) -> Option<(f64, f64)> {
    (0..=1000).map(|i| i as f64 / 1000.0).find_map(|x| {
        let y = x * (a + x * x * (b + c * x * x));
        (y.abs() > 4.0).then_some((x, y))
    })
}
