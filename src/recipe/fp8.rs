//! `train.fp8:` — which blocks run their linears in FP8, and how they scale it.
//!
//! `gemm: emulated` (the default) rounds each GEMM's operands to FP8 as an FP8 GEMM reads them,
//! then multiplies them with the ordinary bf16 (or f32) GEMM (`crates/model/src/llama/fp8.rs`):
//! FP8's numerics on the CPU and on any GPU, without FP8's speed; `gemm: cublaslt` runs FP8
//! GEMMs on the codes (CUDA). The start-up line says which.

use serde::{Deserialize, Serialize};

/// How FP8 linears scale their operands (`train.fp8.scaling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp8Mode {
    /// No FP8: every linear in the model dtype.
    #[default]
    None,
    /// One scale per operand from its current amax (Transformer Engine's current scaling,
    /// torchao's tensorwise).
    Tensorwise,
    /// DeepSeek-V3's blocks: 1 × 128 for activations and gradients, 128 × 128 for weights.
    Blockwise,
}

/// What multiplies the rounded operands (`train.fp8.gemm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp8GemmKind {
    /// The model dtype's GEMMs on the rounded values: FP8's numerics on any device.
    #[default]
    Emulated,
    /// FP8 GEMMs through cuBLASLt on the codes (CUDA, bf16; blockwise scaling on Hopper).
    Cublaslt,
}

/// `train.fp8:`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fp8Config {
    /// `none` (the default), `tensorwise` or `blockwise`.
    #[serde(default)]
    pub scaling: Fp8Mode,
    /// `emulated` (the default) or `cublaslt`.
    #[serde(default)]
    pub gemm: Fp8GemmKind,
    /// The first this many blocks keep their linears in the model dtype (default 1: the first
    /// block's inputs are the embeddings', where FP8's range is tightest).
    #[serde(default = "one")]
    pub bf16_first: usize,
    /// The last this many blocks keep their linears in the model dtype (default 1).
    #[serde(default = "one")]
    pub bf16_last: usize,
}

fn one() -> usize {
    1
}

impl Default for Fp8Config {
    fn default() -> Self {
        Fp8Config {
            scaling: Fp8Mode::None,
            gemm: Fp8GemmKind::Emulated,
            bf16_first: 1,
            bf16_last: 1,
        }
    }
}

impl Fp8Config {
    /// FP8 off (the key is then left out of a written recipe).
    pub fn is_off(&self) -> bool {
        self.scaling == Fp8Mode::None
    }

    /// The model's FP8 linears for a model of `layers` blocks; `None` when FP8 is off.
    pub fn linears(&self, layers: usize) -> Option<model::Fp8Linears> {
        let scaling = match self.scaling {
            Fp8Mode::None => return None,
            Fp8Mode::Tensorwise => model::Fp8Scaling::Tensorwise,
            Fp8Mode::Blockwise => model::Fp8Scaling::Blockwise,
        };
        let end = layers.saturating_sub(self.bf16_last);
        let gemm = match self.gemm {
            Fp8GemmKind::Emulated => model::Fp8Gemm::Emulated,
            Fp8GemmKind::Cublaslt => model::Fp8Gemm::CublasLt,
        };
        Some(model::Fp8Linears {
            scaling,
            gemm,
            layers: self.bf16_first.min(end)..end,
        })
    }

    /// What is wrong with the section in `r`.
    pub fn problems(&self, r: &super::Recipe) -> Vec<String> {
        let mut p = Vec::new();
        let layers = r.model.num_hidden_layers;
        if self.is_off() {
            return p;
        }
        if self.bf16_first.saturating_add(self.bf16_last) >= layers {
            p.push(format!(
                "train.fp8 keeps every block in the model dtype: train.fp8.bf16_first + \
                 bf16_last ({} + {}) leave none of the model's {layers} layers to FP8; lower \
                 them, or set train.fp8.scaling: none",
                self.bf16_first, self.bf16_last
            ));
        }
        if self.gemm == Fp8GemmKind::Cublaslt {
            p.extend(cublaslt_problems(self.scaling, r));
        }
        p
    }

    /// The start-up line's words for the section (`None` when FP8 is off).
    pub fn describe(&self, layers: usize) -> Option<String> {
        let l = self.linears(layers)?;
        let scaling = match self.scaling {
            Fp8Mode::Tensorwise => "tensorwise",
            _ => "blockwise (1x128 activations and gradients, 128x128 weights)",
        };
        let how = match self.gemm {
            Fp8GemmKind::Emulated => {
                "emulated: operands rounded to E4M3 (gradients E5M2), products by the model \
                 dtype's GEMMs (FP8's numerics, not its speed)"
            }
            Fp8GemmKind::Cublaslt => {
                "FP8 GEMMs through cuBLASLt on E4M3 codes (gradients E5M2), fast accumulation \
                 in the forward only"
            }
        };
        Some(format!(
            "fp8 {scaling} on the linears of layers {}..{} of {layers}, {how}",
            l.layers.start, l.layers.end
        ))
    }
}

/// What `train.fp8.gemm: cublaslt` needs: bf16 on CUDA, and every FP8 GEMM dimension a
/// multiple of 16 (cuBLASLt's FP8 kernels read 16-byte rows), or of 128 with blockwise scaling
/// (whole blocks and tiles of scales, as cuBLASLt reads them).
fn cublaslt_problems(scaling: Fp8Mode, r: &super::Recipe) -> Vec<String> {
    let mut p = Vec::new();
    let (t, m) = (&r.train, &r.model);
    if t.device != super::DeviceKind::Cuda || t.dtype != super::Dtype::Bf16 {
        p.push(format!(
            "train.fp8.gemm: cublaslt needs train.device: cuda and train.dtype: bf16 (the \
             recipe has {:?} and {:?}); elsewhere train.fp8.gemm: emulated gives the same \
             numerics",
            t.device, t.dtype
        ));
    }
    let multiple = if scaling == Fp8Mode::Blockwise {
        128
    } else {
        16
    };
    let (tp, cp) = (r.parallel.tp.max(1), r.parallel.cp.max(1));
    let kv = m.num_key_value_heads * m.head_dim();
    for (what, n) in [
        ("model.hidden_size", m.hidden_size),
        ("the query width / parallel.tp", m.q_dim() / tp),
        ("the key-value width / parallel.tp", kv / tp),
        (
            "model.intermediate_size / parallel.tp",
            m.intermediate_size / tp,
        ),
        (
            "train.micro_batch × train.seq_len / parallel.cp",
            t.micro_batch * t.seq_len / cp,
        ),
    ] {
        if n % multiple != 0 {
            p.push(format!(
                "train.fp8.gemm: cublaslt needs {what} ({n}) to be a multiple of {multiple}{}",
                if multiple == 128 {
                    " with blockwise scaling (tensorwise: 16)"
                } else {
                    ""
                }
            ));
        }
    }
    p
}

/// The refusal of FP8 on a GPU that cannot run it (compute capability `cap`, e.g. 80 for 8.0):
/// FP8 tensor cores start at sm_89, and cuBLASLt's block-scaled FP8 GEMMs (`VEC128_32F`,
/// `BLK128x128_32F`) are Hopper's (sm_90).
pub fn device_problem(cap: u32, fp8: &Fp8Config) -> Option<String> {
    let (major, minor) = (cap / 10, cap % 10);
    if cap < 89 {
        return Some(format!(
            "train.fp8 needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, \
             Hopper, Blackwell); this one is {major}.{minor}. Set train.fp8.scaling: none"
        ));
    }
    let blockwise_gemms = fp8.scaling == Fp8Mode::Blockwise && fp8.gemm == Fp8GemmKind::Cublaslt;
    (blockwise_gemms && major != 9).then(|| {
        format!(
            "train.fp8: blockwise scaling with train.fp8.gemm: cublaslt runs cuBLASLt's \
             block-scaled FP8 GEMMs, which are Hopper's (compute capability 9.0); this GPU is \
             {major}.{minor}. Use tensorwise scaling, or train.fp8.gemm: emulated"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_first_and_last_blocks_stay_out_of_fp8_by_default() {
        let c = Fp8Config {
            scaling: Fp8Mode::Blockwise,
            ..Fp8Config::default()
        };
        let l = c.linears(4).unwrap();
        assert_eq!((l.scaling, l.layers), (model::Fp8Scaling::Blockwise, 1..3));
        assert!(Fp8Config::default().linears(4).is_none());
        let all = Fp8Config {
            bf16_first: 0,
            bf16_last: 0,
            ..c
        };
        assert_eq!(all.linears(4).unwrap().layers, 0..4);
        assert_eq!(all.linears(4).unwrap().gemm, model::Fp8Gemm::Emulated);
    }

    #[test]
    fn recipes_name_fp8_problems_and_old_gpus_are_refused() {
        let load = |set: &str| crate::recipe::load(Path::new("recipes/tiny.yaml"), &[set.into()]);
        let r = load("train.fp8.scaling=tensorwise").unwrap();
        assert_eq!(r.train.fp8.scaling, Fp8Mode::Tensorwise);
        let e = format!("{:#}", load("train.fp8.scaling=fp4").unwrap_err());
        assert!(e.contains("fp4"), "{e}");
        let e = format!(
            "{:#}",
            load("train.fp8.scaling=blockwise,train.fp8.bf16_first=2,train.fp8.bf16_last=2")
                .unwrap_err()
        );
        assert!(e.contains("train.fp8.bf16_first"), "{e}");
        let e = format!(
            "{:#}",
            load("train.fp8.scaling=blockwise,train.fp8.gemm=cublaslt").unwrap_err()
        );
        assert!(e.contains("train.device: cuda"), "{e}");
        // The tiny model's widths are not multiples of 128.
        assert!(
            !e.contains("model.hidden_size (128)")
                && e.contains("the key-value width / parallel.tp (64) to be a multiple of 128"),
            "{e}"
        );
        let e =
            format!(
            "{:#}",
            load("train.fp8.scaling=tensorwise,train.fp8.gemm=cublaslt,model.intermediate_size=392")
                .unwrap_err()
        );
        assert!(
            e.contains("model.intermediate_size / parallel.tp (392)"),
            "{e}"
        );
        let fp8 = |scaling, gemm| Fp8Config {
            scaling,
            gemm,
            ..Fp8Config::default()
        };
        let (tw, bw) = (Fp8Mode::Tensorwise, Fp8Mode::Blockwise);
        let (em, lt) = (Fp8GemmKind::Emulated, Fp8GemmKind::Cublaslt);
        assert!(device_problem(80, &fp8(tw, em)).unwrap().contains("8.0"));
        assert!(device_problem(89, &fp8(tw, lt)).is_none());
        assert!(device_problem(90, &fp8(bw, lt)).is_none());
        assert!(device_problem(89, &fp8(bw, em)).is_none());
        for cap in [89, 100, 120] {
            let e = device_problem(cap, &fp8(bw, lt)).unwrap();
            assert!(e.contains("Hopper's (compute capability 9.0)"), "{e}");
        }
    }
}
