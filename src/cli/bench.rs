//! `pretrain bench-attention`: the forward and backward time of one attention call on each
//! backend, as the model calls it (the causal kernels on one context-parallel rank, a ring block
//! for unmasked calls), in TFLOP/s. `bench/attention_gpu.sh` sets it beside PyTorch's SDPA
//! backends on the same shapes.
//!
//! FLOPs are counted as the flash-attention papers do: the forward's two products
//! `4 · b · hq · s · sk · d`, halved under the causal mask; the backward 2.5 times the forward.
//! With `--documents n` (documents of `n` positions packed into each row, kept apart) only the
//! work the mask leaves counts: `s²` becomes the sum of the documents' squared lengths.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Tensor;
use clap::Args;
use model::{ops, AttentionBackend};

use crate::recipe::{DeviceKind, Dtype};

/// Arguments of `pretrain bench-attention`.
#[derive(Debug, Args)]
pub struct AttentionArgs {
    /// Device.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cuda)]
    pub device: DeviceKind,
    /// Backends to time, comma-separated (default: own, and cudnn on CUDA).
    #[arg(long, value_delimiter = ',')]
    pub backend: Vec<AttentionBackend>,
    /// Element type of q, k and v.
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    pub dtype: Dtype,
    /// Batch size.
    #[arg(long, default_value_t = 2)]
    pub batch: usize,
    /// Query positions.
    #[arg(long, default_value_t = 2048)]
    pub seq: usize,
    /// Key positions (default: `--seq`; another number needs `--unmasked`).
    #[arg(long)]
    pub keys: Option<usize>,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    /// Key/value heads.
    #[arg(long, default_value_t = 4)]
    pub kv_heads: usize,
    /// Head dim.
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// Every query sees every key (a ring block) instead of the causal mask.
    #[arg(long)]
    pub unmasked: bool,
    /// Documents of this many positions packed into each row and kept apart (the causal
    /// document mask of `data.reset_attention_mask`; the last one of a row may be shorter).
    #[arg(long, conflicts_with = "unmasked")]
    pub documents: Option<usize>,
    /// Timed calls per direction (after 3 warm-up calls).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Also write the results as JSON.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// One backend's times.
#[derive(Debug, serde::Serialize)]
pub struct AttentionTiming {
    pub backend: String,
    pub shape: String,
    pub fwd_ms: f64,
    pub bwd_ms: f64,
    pub fwd_tflops: f64,
    pub bwd_tflops: f64,
    /// Forward and backward together.
    pub tflops: f64,
}

/// The forward's FLOPs of `a` (the backward's are 2.5 times as many).
fn forward_flops(a: &AttentionArgs, keys: usize) -> f64 {
    let per_pair = 4.0 * (a.batch * a.heads * a.head_dim) as f64;
    if a.unmasked {
        return per_pair * (a.seq * keys) as f64;
    }
    let pairs = match a.documents {
        Some(n) => (0..a.seq)
            .step_by(n)
            .map(|at| (n.min(a.seq - at) as f64).powi(2))
            .sum(),
        None => (a.seq * a.seq) as f64,
    };
    per_pair * pairs / 2.0
}

/// With `--documents n`: each query row's first key (its document's start), `[b · s]`.
fn document_floor(a: &AttentionArgs) -> Option<Vec<u32>> {
    let n = a.documents?;
    let row = (0..a.seq).map(|i| (i - i % n) as u32);
    Some((0..a.batch).flat_map(|_| row.clone()).collect())
}

/// Refuses sizes no call has: zeros, heads that do not group, element counts past `usize`.
fn check_sizes(a: &AttentionArgs, keys: usize) -> Result<()> {
    let sizes = [
        ("--batch", a.batch),
        ("--seq", a.seq),
        ("--keys", keys),
        ("--heads", a.heads),
        ("--kv-heads", a.kv_heads),
        ("--head-dim", a.head_dim),
    ];
    if let Some((flag, _)) = sizes.iter().find(|(_, v)| *v == 0) {
        bail!("{flag} must be at least 1");
    }
    if !a.heads.is_multiple_of(a.kv_heads) {
        bail!(
            "--heads {} is not a multiple of --kv-heads {}: query heads share key/value heads in \
             equal groups",
            a.heads,
            a.kv_heads
        );
    }
    if call_bytes(a, keys).is_none() {
        bail!(
            "--batch {} × --seq {} × --heads {} × --head-dim {} elements overflow",
            a.batch,
            a.seq.max(keys),
            a.heads,
            a.head_dim
        );
    }
    Ok(())
}

/// About the bytes a timed call holds: q, k, v and the output gradient made in f32, the output
/// and the three input gradients; `None` when the counts overflow.
fn call_bytes(a: &AttentionArgs, keys: usize) -> Option<u64> {
    let elems = |pos: usize, heads: usize| {
        a.batch
            .checked_mul(pos)?
            .checked_mul(heads)?
            .checked_mul(a.head_dim)
    };
    let (q, k) = (elems(a.seq, a.heads)?, elems(keys, a.kv_heads)?);
    // q, dout, out, dq (queries) and k, v, dk, dv (keys), 4 bytes each.
    let all = q.checked_mul(4)?.checked_add(k.checked_mul(4)?)?;
    (all as u64).checked_mul(4)
}

/// Runs the benchmark and prints a line per backend.
pub fn bench_attention(a: &AttentionArgs) -> Result<Vec<AttentionTiming>> {
    let keys = a.keys.unwrap_or(a.seq);
    if keys != a.seq && !a.unmasked {
        bail!("--keys {keys} differs from --seq {}: a causal call has as many keys as queries (add --unmasked for a ring block)", a.seq);
    }
    if a.iters == 0 {
        bail!("--iters must be positive");
    }
    if a.documents == Some(0) {
        bail!("--documents must be positive");
    }
    check_sizes(a, keys)?;
    if let Some(path) = &a.json {
        crate::files::check_output("--json", path)?;
    }
    let device = crate::device::device_for(a.device, 0)?;
    let bytes = call_bytes(a, keys).unwrap_or(u64::MAX);
    if let Some(free) = crate::device::capacity(&device).filter(|&free| bytes > free) {
        bail!(
            "the call's tensors take about {:.1} GiB, more than the {:.1} GiB free on the device",
            bytes as f64 / crate::plan::GIB,
            free as f64 / crate::plan::GIB
        );
    }
    let backends = if a.backend.is_empty() {
        let mut b = vec![AttentionBackend::Own];
        if device.is_cuda() {
            b.push(AttentionBackend::Cudnn);
        }
        b
    } else {
        a.backend.clone()
    };
    let dtype = a.dtype.dtype();
    let randn = |shape: (usize, usize, usize, usize)| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1f32, shape, &device)?.to_dtype(dtype)?)
    };
    let q = randn((a.batch, a.seq, a.heads, a.head_dim))?;
    let k = randn((a.batch, keys, a.kv_heads, a.head_dim))?;
    let v = randn((a.batch, keys, a.kv_heads, a.head_dim))?;
    let dout = randn((a.batch, a.seq, a.heads, a.head_dim))?;
    let scale = 1.0 / (a.head_dim as f64).sqrt();
    let shape = format!(
        "b{} s{} sk{} h{}/{} d{} {} {}",
        a.batch,
        a.seq,
        keys,
        a.heads,
        a.kv_heads,
        a.head_dim,
        match a.documents {
            _ if a.unmasked => "unmasked".to_string(),
            Some(n) => format!("documents of {n}"),
            None => "causal".to_string(),
        },
        a.dtype
    );
    let floor = document_floor(a);
    let flops = forward_flops(a, keys);
    let mut out = Vec::new();
    for backend in backends {
        if backend == AttentionBackend::Cudnn && !device.is_cuda() {
            bail!("--backend cudnn needs --device cuda");
        }
        crate::device::prepare_attention(backend)?;
        let kern = ops::attention_kernels(backend);
        let fwd = || -> Result<(Tensor, Tensor)> {
            Ok(if a.unmasked {
                (kern.block)(&q, &k, &v, scale, false, None)?
            } else {
                (kern.causal)(&q, &k, &v, scale, floor.as_deref())?
            })
        };
        let bwd = |(o, l): &(Tensor, Tensor)| -> Result<()> {
            if a.unmasked {
                (kern.block_bwd)(&q, &k, &v, o, &dout, l, scale, false, None)?;
            } else {
                (kern.causal_bwd)(&q, &k, &v, (o, l), &dout, scale, floor.as_deref())?;
            }
            Ok(())
        };
        let saved = fwd()?;
        for _ in 0..3 {
            fwd()?;
            bwd(&saved)?;
        }
        let timed = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
            crate::device::synchronize(&device)?;
            let t0 = Instant::now();
            for _ in 0..a.iters {
                f()?;
            }
            crate::device::synchronize(&device)?;
            Ok(t0.elapsed().as_secs_f64() * 1e3 / a.iters as f64)
        };
        let fwd_ms = timed(&|| fwd().map(drop))?;
        let bwd_ms = timed(&|| bwd(&saved))?;
        let tf = |f: f64, ms: f64| f / (ms * 1e-3) / 1e12;
        let t = AttentionTiming {
            backend: backend.to_string(),
            shape: shape.clone(),
            fwd_ms,
            bwd_ms,
            fwd_tflops: tf(flops, fwd_ms),
            bwd_tflops: tf(2.5 * flops, bwd_ms),
            tflops: tf(3.5 * flops, fwd_ms + bwd_ms),
        };
        println!(
            "{shape} {:>6}: forward {:8.3} ms {:7.2} TFLOP/s, backward {:8.3} ms {:7.2} TFLOP/s, both {:7.2} TFLOP/s",
            t.backend, t.fwd_ms, t.fwd_tflops, t.bwd_ms, t.bwd_tflops, t.tflops
        );
        out.push(t);
    }
    if let Some(path) = &a.json {
        crate::files::write_replacing(path, serde_json::to_string_pretty(&out)?.as_bytes())?;
    }
    Ok(out)
}
