//! Measured GEMM rates by shape: the table `pretrain bench-gemm` writes and `pretrain plan
//! --gemm-table` reads. A GEMM's rate depends on its shape (narrow outputs, short inner
//! dimensions and partial waves of tiles run below the large-GEMM rate), which one fraction of
//! peak cannot say; the table holds what the device reached on the shapes a recipe's layouts
//! produce, each projection's forward, input-gradient and weight-gradient products.
//!
//! A shape the table lacks takes the rate of the nearest measured shape when one lies within
//! [`NEAREST`] (the sum of the three dimensions' log₂ ratios); farther away the planner falls
//! back to the preset's fraction of peak.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::PlanError;

/// How far (the sum over m, n and k of |log₂ of the ratio|) a measured shape may lie from the
/// one priced: one doubling of one dimension, as between adjacent tensor-parallel sizes or
/// micro-batches of a sweep.
pub const NEAREST: f64 = 1.0;

/// GEMM rates measured on one device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GemmTable {
    /// The device (its driver's name, or `cpu`).
    pub device: String,
    /// The operands' element type (`bf16`, `f32`, ...).
    pub dtype: String,
    /// The measured shapes.
    pub gemms: Vec<GemmRate>,
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

impl GemmTable {
    /// Reads and checks a table written by `pretrain bench-gemm`.
    pub fn load(path: &Path) -> Result<Self, PlanError> {
        let bad = |message: String| PlanError::GemmTable {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let table: GemmTable = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if table.gemms.is_empty() {
            return Err(bad("no measured GEMMs".into()));
        }
        for (i, g) in table.gemms.iter().enumerate() {
            if g.m == 0 || g.n == 0 || g.k == 0 {
                return Err(bad(format!("gemms[{i}]: m, n and k must be at least 1")));
            }
            if !(g.tflops.is_finite() && g.tflops > 0.0 && g.tflops <= 1e5) {
                return Err(bad(format!(
                    "gemms[{i}]: tflops must be above 0 and at most 1e5, got {:.3e}",
                    g.tflops
                )));
            }
        }
        Ok(table)
    }

    /// The measured TFLOP/s of `[m, k] × [k, n]`, or of the nearest measured shape within
    /// [`NEAREST`] (the first of equally near ones); `None` when none is that near.
    pub fn rate(&self, m: f64, n: f64, k: f64) -> Option<f64> {
        let log = |a: f64, b: u64| (a / b as f64).log2().abs();
        self.gemms
            .iter()
            .map(|g| (log(m, g.m) + log(n, g.n) + log(k, g.k), g.tflops))
            .filter(|(d, _)| *d <= NEAREST + 1e-9)
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, tflops)| tflops)
    }

    /// The table made available to plans for the rest of the process (a [`super::Hardware`]
    /// stays `Copy` by holding a reference).
    pub fn leak(self) -> &'static GemmTable {
        Box::leak(Box::new(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> GemmTable {
        let rate = |m, n, k, tflops| GemmRate {
            m,
            n,
            k,
            tflops,
            what: String::new(),
        };
        GemmTable {
            device: "test".into(),
            dtype: "bf16".into(),
            gemms: vec![rate(4096, 4096, 4096, 700.0), rate(4096, 256, 2048, 300.0)],
        }
    }

    #[test]
    fn a_measured_shape_gives_its_rate_and_a_near_one_the_nearest() {
        let t = table();
        assert_eq!(t.rate(4096.0, 4096.0, 4096.0), Some(700.0));
        assert_eq!(t.rate(4096.0, 256.0, 2048.0), Some(300.0));
        // Twice the rows of the narrow shape: one doubling away.
        assert_eq!(t.rate(8192.0, 256.0, 2048.0), Some(300.0));
        // Two doublings away from both: unknown.
        assert_eq!(t.rate(16384.0, 512.0, 2048.0), None);
        assert_eq!(t.rate(64.0, 64.0, 64.0), None);
    }

    #[test]
    fn tables_with_bad_entries_are_refused_by_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        let mut t = table();
        t.gemms[1].tflops = f64::NAN;
        std::fs::write(
            &path,
            serde_json::to_string(&t).unwrap().replace("null", "-1"),
        )
        .unwrap();
        let e = GemmTable::load(&path).unwrap_err().to_string();
        assert!(
            e.contains("gemms[1]: tflops") && e.contains("t.json"),
            "{e}"
        );
        t.gemms[1].tflops = 1.0;
        t.gemms[0].k = 0;
        std::fs::write(&path, serde_json::to_string(&t).unwrap()).unwrap();
        let e = GemmTable::load(&path).unwrap_err().to_string();
        assert!(e.contains("gemms[0]: m, n and k"), "{e}");
        std::fs::write(&path, "{\"device\": \"x\"}").unwrap();
        let e = GemmTable::load(&path).unwrap_err().to_string();
        assert!(e.contains("t.json") && e.contains("dtype"), "{e}");
    }
}
