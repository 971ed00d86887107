//! `pretrain selftest`: checks a device end to end against references computed on the CPU.
//!
//! 1. **Ops.** Every op of the op library (the embedding's row sums included), forward and
//!    backward, in f32 and bf16 on the device, against the CPU in f64 on the same random inputs
//!    (normal draws, never zeros; attention with head dims 32, 64 and 128, several tiles long,
//!    GQA groups 2, 4 and 8); the error is `max |device − reference| / max |reference|` per
//!    output and per gradient. Head dim 64 with 8 query heads per KV head over 2048 positions
//!    and the 32000-id vocabulary are the 1B recipes' shapes.
//! 2. **Flat kernels.** Gradient accumulation, the AdamW update, the sum of squares and the
//!    masters cast into the parameters on the device against the CPU kernels, and a weight
//!    gradient's product accumulated into the f32 buffer (f32 and bf16 factors; cuBLAS on a
//!    GPU) against f64.
//! 3. **bf16 training.** Steps of the tiny recipe in bf16 on the device against the same steps in
//!    f32 on the CPU (relative loss difference).
//! 4. **Collective backend.** With NCCL (CUDA builds with the `nccl` feature): a world of one rank
//!    runs every collective through NCCL itself and must return its input.
//! 5. **Thread-ranks.** dp=2 × tp=2, cp=2 and (a tiny MoE) dp=2 × ep=2 thread-ranks sharing the
//!    device against one rank on it.
//! 6. **A 1B decoder block.** One decoder block of the 1B recipes (hidden 2048, 32 query and 4 KV
//!    heads of 64, intermediate 5632), its forward and hand-written backward, in f32 and bf16 on
//!    the device against the same block in f64 on the CPU with the same (device-rounded) weights
//!    and input: the output, the input gradient and every weight gradient. Over the recipes' 2048
//!    positions on a GPU; over 128 on the CPU, where f64 time forces it (the only scaled
//!    dimension).
//! 7. **Rank processes.** Two processes started by the launcher (tp=2 with sequence
//!    parallelism) against one rank: over `tcp` on the CPU, over NCCL with two or more GPUs, where
//!    ZeRO-1, pp 2 and (with four) dp 2 × tp 2 run too (`selftest/processes.rs`).
//! 8. **Attention backends.** The project's attention kernels and, on CUDA, cuDNN's fused
//!    attention, in bf16 against f64 on the CPU: causal calls and an unmasked ring block, forward
//!    and backward (`selftest/attention.rs`).
//! 9. **FP8 rounding.** Rounding to E4M3 and E5M2 by block on the device against the CPU, bit for
//!    bit, a linear of rounded bf16 operands and the three FP8 GEMMs of a linear (cuBLASLt on
//!    CUDA) against f64 (`selftest/fp8.rs`).
//! 10. **Grouped linears.** The experts' projections over uneven runs of rows as one call (one
//!     grouped cuBLAS GEMM on CUDA) against the CPU's per-run products (`selftest/grouped.rs`).
//! 11. **Fused projections.** The SwiGLU on the joined gate/up output against the halves', bit
//!     for bit, and a weight gradient read from a range of a wider gradient's columns
//!     (`selftest/fused.rs`).
//!
//! Each check reports its measured error and its tolerance; any failure makes the command fail.

use std::path::Path;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};

mod attention;
mod block;
mod flat;
mod fp8;
mod fused;
mod grouped;
mod processes;

use crate::recipe::{self, DeviceKind, Recipe};
use crate::train::{device_for, train};
pub use attention::check_attention;
pub use block::check_block;
pub use flat::check_flat_kernels;
pub use fp8::check_fp8;
pub use fused::check_fused;
pub use grouped::check_grouped;

/// One check's outcome.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// The measured error.
    pub error: f64,
    /// The largest error accepted.
    pub tolerance: f64,
}

impl Check {
    /// Whether the error is within the tolerance.
    pub fn passed(&self) -> bool {
        self.error.is_finite() && self.error <= self.tolerance
    }
}

/// `max |a − b| / max |b|` over all elements (f64).
fn rel_error(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?;
    let b = b
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?;
    let diff = (a - &b)?.abs()?.max(0)?.to_scalar::<f64>()?;
    let scale = b.abs()?.max(0)?.to_scalar::<f64>()?.max(1e-30);
    Ok(diff / scale)
}

/// Tolerance of an op (or the decoder block) computed in `dtype` against the f64 reference,
/// relative to the output's largest magnitude. bf16 keeps 8 significant bits, so each rounding
/// of a value is off by up to 2^-9 ≈ 2e-3 of it; the bound allows about fifteen such roundings
/// adding up along the longest chain (the block's input gradient passes through a dozen bf16
/// tensors), 3e-2. f32 (2^-24 per rounding) gets 2e-4, room for sums over thousands of terms.
fn op_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 3e-2,
        _ => 2e-4,
    }
}

/// A deterministic standard-normal tensor (never all zeros).
fn randn(shape: &[usize], seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    // Box–Muller over a counter-based generator: reproducible on every machine.
    let uniform = |i: u64| {
        let mut z =
            seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let v: Vec<f64> = (0..n as u64)
        .map(|i| {
            let (u1, u2) = (uniform(2 * i).max(1e-12), uniform(2 * i + 1));
            (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
        })
        .collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// An op under test: inputs (f64 on the CPU) and the function.
struct OpCase {
    name: &'static str,
    inputs: Vec<Tensor>,
    /// Indices of the inputs that get gradients.
    grads: Vec<usize>,
    f: fn(&[Tensor]) -> candle_core::Result<Tensor>,
}

fn op_cases() -> Result<Vec<OpCase>> {
    let (b, s, hq, hkv, d, h) = (2, 80, 4, 2, 32, 96);
    // The angles of a real RoPE table, so cos² + sin² = 1.
    let angles = (randn(&[s, d / 2], 7)? * 3.0)?;
    let targets: Vec<u32> = (0..b * s).map(|i| ((i * 7919) % 1000) as u32).collect();
    let targets = Tensor::from_vec(targets, b * s, &Device::Cpu)?;
    let targets_v32k: Vec<u32> = (0..256).map(|i| ((i * 104_729) % 32_000) as u32).collect();
    let targets_v32k = Tensor::from_vec(targets_v32k, 256, &Device::Cpu)?;
    // Token ids over a 3000-row table: 1024 positions, ids repeating (the backward sums them).
    let tokens: Vec<u32> = (0..1024).map(|i| ((i * i * 31 + 7) % 997) as u32).collect();
    let tokens = Tensor::from_vec(tokens, 1024, &Device::Cpu)?;
    Ok(vec![
        OpCase {
            name: "embedding",
            inputs: vec![randn(&[3000, 256], 26)?, tokens],
            grads: vec![0],
            f: |x| model::ops::embedding(&x[0], &x[1]),
        },
        OpCase {
            name: "rms_norm",
            inputs: vec![randn(&[b * s, h], 1)?, (randn(&[h], 2)? + 1.0)?],
            grads: vec![0, 1],
            f: |x| model::ops::rms_norm(&x[0], &x[1], 1e-5),
        },
        // The residual addition fused with RMSNorm, and RMSNorm's backward with the residual
        // gradient added (the block's calls; no graph: forward values only).
        OpCase {
            name: "add_rms_norm",
            inputs: vec![
                randn(&[b * s, h], 27)?,
                randn(&[b * s, h], 28)?,
                (randn(&[h], 29)? + 1.0)?,
            ],
            grads: vec![],
            f: |x| {
                let (sum, y) = model::ops::add_rms_norm(&x[0], &x[1], &x[2], 1e-5)?;
                Tensor::cat(&[sum, y], 0)
            },
        },
        OpCase {
            name: "rms_norm_bwd_add",
            inputs: vec![
                randn(&[b * s, h], 30)?,
                (randn(&[h], 31)? + 1.0)?,
                randn(&[b * s, h], 32)?,
                randn(&[b * s, h], 33)?,
            ],
            grads: vec![],
            f: |x| {
                let (dx, dw) = model::ops::rms_norm_bwd_add(&x[0], &x[1], 1e-5, &x[2], &x[3])?;
                Tensor::cat(&[dx.flatten_all()?, dw], 0)
            },
        },
        OpCase {
            name: "rope",
            inputs: vec![randn(&[b, s, hq, d], 3)?, angles.cos()?, angles.sin()?],
            grads: vec![0],
            f: |x| model::ops::rope(&x[0], &x[1], &x[2]),
        },
        OpCase {
            name: "swiglu",
            inputs: vec![(randn(&[b * s, h], 4)? * 3.0)?, randn(&[b * s, h], 5)?],
            grads: vec![0, 1],
            f: |x| model::ops::swiglu(&x[0], &x[1]),
        },
        OpCase {
            name: "causal_attention",
            inputs: vec![
                randn(&[b, s, hq, d], 8)?,
                randn(&[b, s, hkv, d], 9)?,
                randn(&[b, s, hkv, d], 10)?,
            ],
            grads: vec![0, 1, 2],
            f: |x| model::ops::causal_attention(&x[0], &x[1], &x[2], 1.0 / (32f64).sqrt()),
        },
        OpCase {
            name: "causal_attention d128",
            inputs: vec![
                randn(&[1, 257, 4, 128], 12)?,
                randn(&[1, 257, 1, 128], 13)?,
                randn(&[1, 257, 1, 128], 14)?,
            ],
            grads: vec![0, 1, 2],
            f: |x| model::ops::causal_attention(&x[0], &x[1], &x[2], 1.0 / (128f64).sqrt()),
        },
        // The 1B recipes' attention: head dim 64 (tensor-core kernels in bf16), 8 query heads per
        // KV head, their sequence of 2048 (32 tiles of 64 rows).
        OpCase {
            name: "causal_attention d64 gqa8 s2048",
            inputs: vec![
                randn(&[1, 2048, 8, 64], 22)?,
                randn(&[1, 2048, 1, 64], 23)?,
                randn(&[1, 2048, 1, 64], 24)?,
            ],
            grads: vec![0, 1, 2],
            f: |x| model::ops::causal_attention(&x[0], &x[1], &x[2], 1.0 / 8.0),
        },
        // An unmasked block of context-parallel ring attention (queries after all of its keys):
        // forward, and the block backward from the forward's own output and log-sum-exp.
        OpCase {
            name: "attention_block unmasked",
            inputs: vec![
                randn(&[b, s, hq, d], 15)?,
                randn(&[b, s / 2, hkv, d], 16)?,
                randn(&[b, s / 2, hkv, d], 17)?,
            ],
            grads: vec![],
            f: |x| {
                let (o, _) = model::ops::attention_block(&x[0], &x[1], &x[2], 0.2, false, None)?;
                o.to_dtype(x[0].dtype())
            },
        },
        OpCase {
            name: "attention_block_bwd unmasked (dq, dk, dv)",
            inputs: vec![
                randn(&[b, s, hq, d], 18)?,
                randn(&[b, s / 2, hkv, d], 19)?,
                randn(&[b, s / 2, hkv, d], 20)?,
                randn(&[b, s, hq, d], 21)?,
            ],
            grads: vec![],
            f: |x| {
                let (o, lse) = model::ops::attention_block(&x[0], &x[1], &x[2], 0.2, false, None)?;
                let o = o.to_dtype(x[0].dtype())?;
                let (dq, dk, dv) = model::ops::attention_block_bwd(
                    &x[0], &x[1], &x[2], &o, &x[3], &lse, 0.2, false, None,
                )?;
                candle_core::Tensor::cat(
                    &[dq.flatten_all()?, dk.flatten_all()?, dv.flatten_all()?],
                    0,
                )?
                .to_dtype(x[0].dtype())
            },
        },
        OpCase {
            name: "cross_entropy",
            inputs: vec![(randn(&[b * s, 1000], 11)? * 4.0)?, targets],
            grads: vec![0],
            f: |x| model::ops::cross_entropy(&x[0], &x[1]),
        },
        // The recipes' vocabulary (32000) over 256 rows.
        OpCase {
            name: "cross_entropy v32000",
            inputs: vec![(randn(&[256, 32_000], 25)? * 4.0)?, targets_v32k],
            grads: vec![0],
            f: |x| model::ops::cross_entropy(&x[0], &x[1]),
        },
    ])
}

/// Forward output and input gradients of `case` with float inputs in `dtype` on `device` (integer
/// inputs kept as they are), the gradients taken of `Σ y ∘ r` for a fixed random `r`.
fn run_op(case: &OpCase, dtype: DType, device: &Device) -> Result<Vec<Tensor>> {
    let vars: Vec<Var> = case
        .inputs
        .iter()
        .map(|t| {
            let t = if t.dtype().is_float() {
                t.to_dtype(dtype)?
            } else {
                t.clone()
            };
            Var::from_tensor(&t.to_device(device)?)
        })
        .collect::<candle_core::Result<_>>()?;
    let xs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = (case.f)(&xs)?;
    let r = randn(y.dims(), 99)?.to_dtype(dtype)?.to_device(device)?;
    let grads = (&y * &r)?.sum_all()?.backward()?;
    let mut out = vec![y];
    for &i in &case.grads {
        match grads.get(&xs[i]) {
            Some(g) => out.push(g.clone()),
            None => bail!("{}: no gradient for input {i}", case.name),
        }
    }
    Ok(out)
}

/// Check 1: every op, forward and backward, in f32 and bf16 against the f64 CPU reference.
pub fn check_ops(device: &Device) -> Result<Vec<Check>> {
    let mut checks = Vec::new();
    for case in op_cases()? {
        let reference = run_op(&case, DType::F64, &Device::Cpu)?;
        for dtype in [DType::F32, DType::BF16] {
            let got = run_op(&case, dtype, device)?;
            for (k, (g, r)) in got.iter().zip(&reference).enumerate() {
                let what = if k == 0 {
                    "forward".to_string()
                } else {
                    format!("grad of input {}", case.grads[k - 1])
                };
                checks.push(Check {
                    name: format!("{} {what} {dtype:?}", case.name),
                    error: rel_error(g, r)?,
                    tolerance: op_tolerance(dtype),
                });
            }
        }
    }
    Ok(checks)
}

/// The overrides that cut the tiny recipe to `steps` steps on `device` in `dtype`.
fn tiny_overrides(steps: usize, device: &str, dtype: &str) -> String {
    format!(
        "train.steps={steps},schedule.warmup_steps=1,train.eval_interval=0,checkpoint.interval=0,\
         train.global_batch=16,train.device={device},train.dtype={dtype}"
    )
}

/// The tiny recipe cut to `steps` steps on `device_kind` in `dtype`, with `extra` overrides.
fn tiny(recipe: &Path, steps: usize, device: &str, dtype: &str, extra: &str) -> Result<Recipe> {
    let mut o = vec![tiny_overrides(steps, device, dtype)];
    if !extra.is_empty() {
        o.push(extra.to_string());
    }
    Ok(recipe::load(recipe, &o)?)
}

fn losses(r: Recipe) -> Result<Vec<f64>> {
    Ok(train(r, false)?.records.iter().map(|s| s.loss).collect())
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-30))
        .fold(0.0, f64::max)
}

/// Checks 3 and 5: bf16 training on the device against f32 on the CPU; dp=2 × tp=2, cp=2 and
/// (a tiny MoE) dp=2 × ep=2 thread-ranks sharing the device against one rank on it; check 7
/// (rank processes, `processes.rs`).
pub fn check_training(kind: DeviceKind, recipe: &Path) -> Result<Vec<Check>> {
    let dev = match kind {
        DeviceKind::Cpu => "cpu",
        DeviceKind::Cuda => "cuda",
    };
    let cpu_f32 = losses(tiny(recipe, 3, "cpu", "f32", "")?)?;
    let dev_bf16 = losses(tiny(recipe, 3, dev, "bf16", "")?)?;
    let one = losses(tiny(recipe, 3, dev, "f32", "")?)?;
    let four = losses(tiny(recipe, 3, dev, "f32", "parallel.dp=2,parallel.tp=2")?)?;
    let ring = losses(tiny(recipe, 3, dev, "f32", "parallel.cp=2")?)?;
    let moe = processes::MOE;
    let moe_one = losses(tiny(recipe, 3, dev, "f32", moe)?)?;
    let moe_ep = losses(tiny(
        recipe,
        3,
        dev,
        "f32",
        &format!("{moe},parallel.dp=2,parallel.ep=2"),
    )?)?;
    let muon = "optimizer.name=muon";
    let muon_one = losses(tiny(recipe, 3, dev, "f32", muon)?)?;
    let muon_four = losses(tiny(
        recipe,
        3,
        dev,
        "f32",
        &format!("{muon},parallel.dp=2,parallel.tp=2,parallel.zero=1"),
    )?)?;
    // Muon iterates in bf16 on a GPU: the layouts' f32 rounding differences can flip a bf16
    // rounding, so its bound there is wider.
    let muon_tolerance = if kind == DeviceKind::Cuda { 1e-3 } else { 1e-5 };
    let mut checks = vec![
        Check {
            name: format!("bf16 training steps on {dev} vs f32 on cpu (loss)"),
            error: max_rel(&dev_bf16, &cpu_f32),
            tolerance: 2e-2,
        },
        Check {
            name: format!("dp2 x tp2 thread-ranks sharing {dev} vs one rank (loss)"),
            error: max_rel(&four, &one),
            tolerance: 1e-5,
        },
        Check {
            name: format!("cp2 thread-ranks (ring attention) sharing {dev} vs one rank (loss)"),
            error: max_rel(&ring, &one),
            tolerance: 1e-5,
        },
        Check {
            name: format!("MoE ep2 thread-ranks sharing {dev} vs one rank (loss)"),
            error: max_rel(&moe_ep, &moe_one),
            tolerance: 1e-5,
        },
        Check {
            name: format!("Muon dp2 x tp2 ZeRO-1 thread-ranks sharing {dev} vs one rank (loss)"),
            error: max_rel(&muon_four, &muon_one),
            tolerance: muon_tolerance,
        },
    ];
    let one_of = |model: &str| -> Result<Vec<f64>> {
        match model {
            "" => Ok(one.clone()),
            m if m == moe => Ok(moe_one.clone()),
            m => losses(tiny(recipe, 3, dev, "f32", m)?),
        }
    };
    let across = processes::check_processes(kind, recipe, &one_of)?;
    if across.is_empty() {
        eprintln!(
            "selftest: one GPU, so no NCCL check across processes (it needs two; NCCL refuses \
             two ranks on one device)"
        );
    }
    checks.extend(across);
    Ok(checks)
}

/// Check 4: the NCCL backend in a world of one rank (CUDA builds with `nccl`).
#[cfg(feature = "nccl")]
pub fn check_nccl(device: &Device) -> Result<Vec<Check>> {
    use parallel::store::{Store, StoreServer};
    let timeout = std::time::Duration::from_secs(60);
    let server = StoreServer::start("127.0.0.1:0", "selftest", timeout)?;
    let store = Store::connect(&server.addr().to_string(), "selftest", timeout)?;
    let comm = std::sync::Arc::new(parallel::comm::nccl::NcclComm::new(
        0,
        1,
        store,
        device.as_cuda_device()?.clone(),
        timeout,
    )?);
    let x = randn(&[4096], 31)?
        .to_dtype(DType::F32)?
        .to_device(device)?;
    let y = comm.self_check(&x)?;
    // A non-blocking communicator's creation answers "in progress" (NCCL initialises it on a
    // thread of its own); a blocking one would answer at once.
    let deferred = comm.deferred_calls();
    Ok(vec![
        Check {
            name: "nccl world=1 collectives return their input".into(),
            error: rel_error(&y, &x)?,
            tolerance: 0.0,
        },
        Check {
            name: format!("nccl communicators are non-blocking ({deferred} calls settled)"),
            error: if deferred > 0 { 0.0 } else { 1.0 },
            tolerance: 0.0,
        },
    ])
}

/// Every check for `kind`; `recipe` is the tiny recipe (its data must be present).
pub fn run(kind: DeviceKind, recipe: &Path) -> Result<Vec<Check>> {
    let device = device_for(kind, 0)?;
    let mut checks = check_ops(&device)?;
    checks.extend(check_flat_kernels(&device)?);
    #[cfg(feature = "nccl")]
    if device.is_cuda() {
        checks.extend(check_nccl(&device)?);
    }
    checks.extend(check_training(kind, recipe)?);
    let seq = if device.is_cuda() { 2048 } else { 128 };
    checks.extend(check_block(&device, seq)?);
    checks.extend(check_attention(&device)?);
    checks.extend(check_fp8(&device)?);
    checks.extend(check_grouped(&device)?);
    checks.extend(check_fused(&device)?);
    Ok(checks)
}
