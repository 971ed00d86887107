//! Measured rates of a device: the table `pretrain bench-rates` writes and `pretrain plan
//! --rates` reads. The roofline's single fractions of peak say nothing of shape: a GEMM's rate
//! falls for narrow outputs, short inner dimensions and partial waves of tiles; attention's with
//! the head dim and the sequence length; and element-wise kernels stream at what the device's
//! memory (or, for small tensors on a CPU, its caches) gives. The table holds what the device
//! reached on the shapes a recipe's layouts produce:
//!
//! - every projection's forward, input-gradient and weight-gradient GEMM;
//! - the causal attention's forward and backward, by head dim and sequence length;
//! - the bandwidth of an element-wise kernel on a tensor of the step's size.
//!
//! A GEMM the table lacks takes the rate of the nearest measured shape within [`NEAREST`] (the
//! sum of the three dimensions' log₂ ratios), attention the rate of its head dim at the nearest
//! length within one doubling; farther away, or without a measured bandwidth, the planner falls
//! back to the preset's fractions of peak.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::PlanError;

/// How far (the sum over m, n and k of |log₂ of the ratio|) a measured GEMM may lie from the one
/// priced: one doubling of one dimension, as between adjacent tensor-parallel sizes or
/// micro-batches of a sweep.
pub const NEAREST: f64 = 1.0;

/// Rates measured on one device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rates {
    /// The device (its driver's name, or `cpu`).
    pub device: String,
    /// The operands' element type (`bf16`, `f32`, ...).
    pub dtype: String,
    /// The measured GEMMs.
    pub gemms: Vec<GemmRate>,
    /// The measured causal attention calls.
    #[serde(default)]
    pub attention: Vec<AttentionRate>,
    /// Element-wise kernels' streaming rate (bytes read and written), GB/s.
    #[serde(default)]
    pub bandwidth_gbps: Option<f64>,
    /// The GEMMs as the recipe's FP8 linears run them (`train.fp8`: the operands' rounding or
    /// quantizing included), measured when the recipe has FP8 on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fp8_gemms: Vec<GemmRate>,
}

/// One measured GEMM: `[m, k] × [k, n]` at `tflops`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GemmRate {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// Achieved TFLOP/s (`2·m·n·k` FLOPs over the measured time).
    pub tflops: f64,
    /// What the shape is (e.g. `q fwd tp2 mb4`).
    #[serde(default)]
    pub what: String,
}

/// One measured causal attention call (FLOPs counted as `pretrain bench-attention` counts them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionRate {
    pub head_dim: u64,
    /// Sequence length.
    pub seq: u64,
    /// Forward and backward TFLOP/s.
    pub fwd_tflops: f64,
    pub bwd_tflops: f64,
    #[serde(default)]
    pub what: String,
}

impl Rates {
    /// Reads and checks a table written by `pretrain bench-rates`.
    pub fn load(path: &Path) -> Result<Self, PlanError> {
        let bad = |message: String| PlanError::Rates {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let rates: Rates = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if rates.gemms.is_empty() {
            return Err(bad("no measured GEMMs".into()));
        }
        let rate = |field: String, v: f64| match v.is_finite() && v > 0.0 && v <= 1e5 {
            true => Ok(()),
            false => Err(bad(format!(
                "{field} must be above 0 and at most 1e5, got {v:.3e}"
            ))),
        };
        for (list, gemms) in [("gemms", &rates.gemms), ("fp8_gemms", &rates.fp8_gemms)] {
            for (i, g) in gemms.iter().enumerate() {
                if g.m == 0 || g.n == 0 || g.k == 0 {
                    return Err(bad(format!("{list}[{i}]: m, n and k must be at least 1")));
                }
                rate(format!("{list}[{i}]: tflops"), g.tflops)?;
            }
        }
        for (i, a) in rates.attention.iter().enumerate() {
            if a.head_dim == 0 || a.seq == 0 {
                return Err(bad(format!(
                    "attention[{i}]: head_dim and seq must be at least 1"
                )));
            }
            rate(format!("attention[{i}]: fwd_tflops"), a.fwd_tflops)?;
            rate(format!("attention[{i}]: bwd_tflops"), a.bwd_tflops)?;
        }
        if let Some(b) = rates.bandwidth_gbps {
            rate("bandwidth_gbps".into(), b)?;
        }
        Ok(rates)
    }

    /// The measured TFLOP/s of `[m, k] × [k, n]`, or of the nearest measured shape within
    /// [`NEAREST`] (the first of equally near ones); `None` when none is that near.
    pub fn gemm(&self, m: f64, n: f64, k: f64) -> Option<f64> {
        nearest(&self.gemms, m, n, k)
    }

    /// [`Rates::gemm`] of the FP8 linears' GEMMs (`fp8_gemms`).
    pub fn fp8_gemm(&self, m: f64, n: f64, k: f64) -> Option<f64> {
        nearest(&self.fp8_gemms, m, n, k)
    }

    /// The measured forward and backward TFLOP/s of causal attention at `head_dim` and the
    /// nearest measured length within one doubling of `seq`.
    pub fn attention(&self, head_dim: usize, seq: f64) -> Option<(f64, f64)> {
        self.attention
            .iter()
            .filter(|a| a.head_dim == head_dim as u64)
            .map(|a| ((seq / a.seq as f64).log2().abs(), a))
            .filter(|(d, _)| *d <= 1.0 + 1e-9)
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, a)| (a.fwd_tflops, a.bwd_tflops))
    }

    /// The table made available to plans for the rest of the process (a [`super::Hardware`]
    /// stays `Copy` by holding a reference).
    pub fn leak(self) -> &'static Rates {
        Box::leak(Box::new(self))
    }
}

/// The TFLOP/s of the entry of `gemms` nearest `[m, k] × [k, n]` within [`NEAREST`] (the
/// first of equally near ones).
fn nearest(gemms: &[GemmRate], m: f64, n: f64, k: f64) -> Option<f64> {
    let log = |a: f64, b: u64| (a / b as f64).log2().abs();
    gemms
        .iter()
        .map(|g| (log(m, g.m) + log(n, g.n) + log(k, g.k), g.tflops))
        .filter(|(d, _)| *d <= NEAREST + 1e-9)
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, tflops)| tflops)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates() -> Rates {
        let rate = |m, n, k, tflops| GemmRate {
            m,
            n,
            k,
            tflops,
            what: String::new(),
        };
        let attention = |head_dim, seq, fwd_tflops| AttentionRate {
            head_dim,
            seq,
            fwd_tflops,
            bwd_tflops: fwd_tflops / 2.0,
            what: String::new(),
        };
        Rates {
            device: "test".into(),
            dtype: "bf16".into(),
            gemms: vec![rate(4096, 4096, 4096, 700.0), rate(4096, 256, 2048, 300.0)],
            attention: vec![attention(64, 2048, 200.0), attention(128, 4096, 400.0)],
            bandwidth_gbps: Some(3000.0),
            fp8_gemms: vec![rate(4096, 4096, 4096, 1100.0)],
        }
    }

    #[test]
    fn a_measured_shape_gives_its_rate_and_a_near_one_the_nearest() {
        let t = rates();
        assert_eq!(t.gemm(4096.0, 4096.0, 4096.0), Some(700.0));
        assert_eq!(t.fp8_gemm(4096.0, 4096.0, 4096.0), Some(1100.0));
        assert_eq!(t.fp8_gemm(4096.0, 256.0, 2048.0), None);
        assert_eq!(t.gemm(4096.0, 256.0, 2048.0), Some(300.0));
        // Twice the rows of the narrow shape: one doubling away.
        assert_eq!(t.gemm(8192.0, 256.0, 2048.0), Some(300.0));
        // Two doublings away from both: unknown.
        assert_eq!(t.gemm(16384.0, 512.0, 2048.0), None);
        assert_eq!(t.gemm(64.0, 64.0, 64.0), None);
        // Attention: its own head dim only, within one doubling of the length.
        assert_eq!(t.attention(64, 4096.0), Some((200.0, 100.0)));
        assert_eq!(t.attention(64, 8192.0), None);
        assert_eq!(t.attention(128, 2048.0), Some((400.0, 200.0)));
        assert_eq!(t.attention(96, 2048.0), None);
    }

    #[test]
    fn tables_with_bad_entries_are_refused_by_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        let refused = |t: &Rates| {
            std::fs::write(&path, serde_json::to_string(t).unwrap()).unwrap();
            Rates::load(&path).unwrap_err().to_string()
        };
        let mut t = rates();
        t.gemms[1].tflops = -1.0;
        let e = refused(&t);
        assert!(
            e.contains("gemms[1]: tflops") && e.contains("t.json"),
            "{e}"
        );
        t = rates();
        t.gemms[0].k = 0;
        assert!(refused(&t).contains("gemms[0]: m, n and k"));
        t = rates();
        t.attention[1].bwd_tflops = 0.0;
        assert!(refused(&t).contains("attention[1]: bwd_tflops"));
        t = rates();
        t.fp8_gemms[0].tflops = -2.0;
        assert!(refused(&t).contains("fp8_gemms[0]: tflops"));
        t = rates();
        t.bandwidth_gbps = Some(1e9);
        assert!(refused(&t).contains("bandwidth_gbps"));
        std::fs::write(&path, "{\"device\": \"x\"}").unwrap();
        let e = Rates::load(&path).unwrap_err().to_string();
        assert!(e.contains("t.json") && e.contains("dtype"), "{e}");
    }
}
