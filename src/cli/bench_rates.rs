//! `pretrain bench-rates`: what a recipe's step runs, timed on the recipe's device and dtype
//! through the step's own calls, as the table `pretrain plan --rates` prices steps from
//! (`plan::rates`):
//!
//! - every GEMM of its layouts: each projection's forward (`x · wᵀ`), input gradient (`g · w`)
//!   and weight gradient (`gᵀ · x` accumulated into an f32 buffer), over tensor-parallel sizes
//!   and micro-batches;
//! - the causal attention's forward and backward on the recipe's backend at its sequence length
//!   (FLOPs counted as `pretrain bench-attention` counts them);
//! - the bandwidth of an element-wise kernel (the residual addition) on tensors of the size of a
//!   micro-batch's MLP activations;
//! - with `train.fp8` on, the block's projections again as its FP8 linears run them, rounding or
//!   quantizing included (the table's `fp8_gemms`).

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use model::ops;

use crate::cli::RecipeArgs;
use crate::plan::rates::{AttentionRate, GemmRate, Rates};
use crate::recipe::Recipe;

/// Arguments of `pretrain bench-rates`.
#[derive(Debug, Args)]
pub struct RatesArgs {
    /// The recipe (its model, sequence length, dtype and device).
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// Tensor-parallel sizes to sweep (default: 1, 2, 4 and 8, those that split the heads).
    #[arg(long, value_delimiter = ',')]
    pub tp: Vec<usize>,
    /// Micro-batch sizes to sweep (default: 1, 2, 4 and 8).
    #[arg(long, value_delimiter = ',')]
    pub micro_batch: Vec<usize>,
    /// Timed calls per measurement (after two warm-up calls).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Also write the table as JSON (what `pretrain plan --rates` reads).
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

/// A projection of `rows` rows from `inp` to `out` features, named.
struct Projection {
    what: String,
    rows: usize,
    out: usize,
    inp: usize,
}

/// The projections of `r`'s model at tensor-parallel size `tp` and micro-batch `mb` (one of each
/// kind: k and v share a shape, as do gate and up), and the fused GEMMs of q, k and v and of
/// gate and up (FP8 linears run them one by one).
fn projections(r: &Recipe, tp: usize, mb: usize) -> Vec<Projection> {
    let c = &r.model;
    let rows = mb * r.train.seq_len / r.parallel.cp;
    let (h, q, kv) = (
        c.hidden_size,
        c.q_dim(),
        c.num_key_value_heads * c.head_dim(),
    );
    let at = format!("tp{tp} mb{mb}");
    let p = |what: &str, rows: usize, out: usize, inp: usize| Projection {
        what: format!("{what} {at}"),
        rows,
        out,
        inp,
    };
    let mut all = vec![
        p("q", rows, q / tp, h),
        p("k/v", rows, kv / tp, h),
        p("q+k+v", rows, (q + 2 * kv) / tp, h),
        p("o", rows, h, q / tp),
        p("head", rows, c.vocab_size / tp, h),
    ];
    match c.moe() {
        Some(m) => {
            // Experts are not split over tensor-parallel ranks; each routes the tokens it holds.
            let held = if r.parallel.sequence_parallel {
                rows / tp
            } else {
                rows
            };
            let per = (held * m.top_k * r.parallel.ep / m.num_experts).max(1);
            all.push(p("router", held, m.num_experts, h));
            all.push(p("expert gate/up", per, m.expert_size, h));
            all.push(p("expert down", per, h, m.expert_size));
        }
        None => {
            all.push(p("gate/up", rows, c.intermediate_size / tp, h));
            all.push(p("gate+up", rows, 2 * c.intermediate_size / tp, h));
            all.push(p("down", rows, h, c.intermediate_size / tp));
        }
    }
    all.retain(|p| p.rows > 0 && p.out > 0 && p.inp > 0);
    all
}

/// Seconds per call of `f`, over `iters` calls after two warm-up calls.
fn timed(device: &Device, iters: usize, f: &dyn Fn() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    crate::device::synchronize(device)?;
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    crate::device::synchronize(device)?;
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}

/// `p`'s operands: `x` `[rows, in]`, `w` `[out, in]` and `g` `[rows, out]` drawn in `dtype`,
/// and an f32 gradient slot `[out · in]`.
fn operands(p: &Projection, dtype: DType, device: &Device) -> Result<[Tensor; 4]> {
    let randn = |shape: (usize, usize)| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1f32, shape, device)?.to_dtype(dtype)?)
    };
    Ok([
        randn((p.rows, p.inp))?,
        randn((p.out, p.inp))?,
        randn((p.rows, p.out))?,
        Tensor::zeros(p.out * p.inp, DType::F32, device)?,
    ])
}

/// The rates of `p`'s three products, as the step runs them: forward, input gradient, weight
/// gradient.
fn measure(p: &Projection, dtype: DType, device: &Device, iters: usize) -> Result<[GemmRate; 3]> {
    let [x, w, g, dst] = operands(p, dtype, device)?;
    let fwd = timed(device, iters, &|| Ok(ops::linear(&x, &w).map(drop)?))?;
    let dx = timed(device, iters, &|| {
        Ok(ops::linear_dx(&w, &g, x.shape()).map(drop)?)
    })?;
    let dw = timed(device, iters, &|| {
        Ok(crate::optim::kernels::add_product_into(&dst, &g, &x)?)
    })?;
    Ok(rates_of(p, [fwd, dx, dw], ""))
}

/// `p`'s forward, input-gradient and weight-gradient rates from their seconds per call (named
/// with `tag`, e.g. `fp8`, when not empty).
fn rates_of(p: &Projection, [fwd, dx, dw]: [f64; 3], tag: &str) -> [GemmRate; 3] {
    let flops = 2.0 * (p.rows * p.out * p.inp) as f64;
    let what = match tag {
        "" => p.what.clone(),
        t => format!("{} {t}", p.what),
    };
    let rate = |(m, n, k): (usize, usize, usize), secs: f64, dir: &str| GemmRate {
        m: m as u64,
        n: n as u64,
        k: k as u64,
        tflops: flops / secs / 1e12,
        what: format!("{what} {dir}"),
    };
    [
        rate((p.rows, p.out, p.inp), fwd, "fwd"),
        rate((p.rows, p.inp, p.out), dx, "dx"),
        rate((p.out, p.inp, p.rows), dw, "dw"),
    ]
}

/// The rates of `p`'s three products as the recipe's FP8 linears run them (`train.fp8`, `how`),
/// the operands' rounding or quantizing included but the weight's, which the model makes once a
/// step: the forward (with its input's), the input gradient (with the weight gradient's
/// factors' rounding) and the weight gradient's accumulation.
fn measure_fp8(
    p: &Projection,
    how: model::llama::Fp8Mode,
    dtype: DType,
    device: &Device,
    iters: usize,
) -> Result<[GemmRate; 3]> {
    use model::llama::{fp8_input_operand, fp8_projection_bwd_of, fp8_weight_operand};
    use model::segment::ParamGrad;
    let [x, w, g, dst] = operands(p, dtype, device)?;
    let wq = fp8_weight_operand(&w, how)?;
    let fwd = timed(device, iters, &|| {
        let xq = fp8_input_operand(&x, p.inp, how)?;
        Ok(model::ops::fp8_linear_of(&xq, &wq, (p.rows, p.out)).map(drop)?)
    })?;
    let dx = timed(device, iters, &|| {
        Ok(fp8_projection_bwd_of(&x, None, &wq, &g, how).map(drop)?)
    })?;
    let (_, factors) = fp8_projection_bwd_of(&x, None, &wq, &g, how)?;
    use crate::optim::kernels::{add_fp8_product_into, add_product_into};
    let dw = timed(device, iters, &|| match &factors {
        ParamGrad::Product { g, x } => Ok(add_product_into(&dst, g, x)?),
        ParamGrad::Fp8Product { g, x } => Ok(add_fp8_product_into(&dst, g, x, false)?),
        ParamGrad::Tensor(_) => bail!("an FP8 linear's weight gradient is a product"),
    })?;
    Ok(rates_of(p, [fwd, dx, dw], "fp8"))
}

/// The causal attention's forward and backward at `r`'s model and sequence length on `r`'s
/// backend, micro-batch `mb`, all heads.
fn attention(r: &Recipe, mb: usize, device: &Device, iters: usize) -> Result<AttentionRate> {
    let c = &r.model;
    let (s, d) = (r.train.seq_len, c.head_dim());
    let dtype = r.train.dtype.dtype();
    let randn = |heads: usize| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1f32, (mb, s, heads, d), device)?.to_dtype(dtype)?)
    };
    let (q, k, v) = (
        randn(c.num_attention_heads)?,
        randn(c.num_key_value_heads)?,
        randn(c.num_key_value_heads)?,
    );
    let dout = randn(c.num_attention_heads)?;
    let backend = r.train.attention_backend();
    crate::device::prepare_attention(backend)?;
    let kern = ops::attention_kernels(backend);
    let scale = 1.0 / (d as f64).sqrt();
    let (o, l) = (kern.causal)(&q, &k, &v, scale, None)?;
    let fwd = timed(device, iters, &|| {
        Ok((kern.causal)(&q, &k, &v, scale, None).map(drop)?)
    })?;
    let bwd = timed(device, iters, &|| {
        Ok((kern.causal_bwd)(&q, &k, &v, (&o, &l), &dout, scale, None).map(drop)?)
    })?;
    // Causal: half of QKᵀ and PV's 4 · b · heads · s² · d.
    let flops = 2.0 * (mb * c.num_attention_heads * d) as f64 * (s * s) as f64;
    Ok(AttentionRate {
        head_dim: d as u64,
        seq: s as u64,
        fwd_tflops: flops / fwd / 1e12,
        bwd_tflops: 2.5 * flops / bwd / 1e12,
        what: format!(
            "{backend} b{mb} s{s} h{}/{} d{d}",
            c.num_attention_heads, c.num_key_value_heads
        ),
    })
}

/// GB/s of the residual addition on `[rows, f]` tensors (two read, one written).
fn bandwidth(shape: (usize, usize), dtype: DType, device: &Device, iters: usize) -> Result<f64> {
    let a = Tensor::randn(0f32, 1f32, shape, device)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1f32, shape, device)?.to_dtype(dtype)?;
    let secs = timed(device, iters, &|| Ok(ops::add(&a, &b).map(drop)?))?;
    Ok(3.0 * (shape.0 * shape.1 * dtype.size_in_bytes()) as f64 / secs / 1e9)
}

/// Runs the sweep, prints a line per measurement and returns the table.
pub fn bench_rates(a: &RatesArgs) -> Result<Rates> {
    let r = a.recipe.load()?;
    if a.iters == 0 {
        bail!("--iters must be positive");
    }
    if let Some(path) = &a.json_out {
        crate::files::check_output("--json-out", path)?;
    }
    let heads = (r.model.num_attention_heads, r.model.num_key_value_heads);
    let tps = match a.tp.as_slice() {
        [] => [1, 2, 4, 8]
            .into_iter()
            .filter(|t| heads.0 % t == 0 && heads.1 % t == 0)
            .collect(),
        given => given.to_vec(),
    };
    let mbs = match a.micro_batch.as_slice() {
        [] => vec![1, 2, 4, 8],
        given => given.to_vec(),
    };
    if let Some(t) = tps
        .iter()
        .find(|&&t| t == 0 || heads.0 % t != 0 || heads.1 % t != 0)
    {
        bail!(
            "--tp {t} does not split the {} query and {} key/value heads",
            heads.0,
            heads.1
        );
    }
    if mbs.contains(&0) {
        bail!("--micro-batch sizes must be at least 1");
    }
    let device = crate::device::device_for(r.train.device, 0)?;
    let dtype = r.train.dtype.dtype();
    let free = crate::device::capacity(&device);
    let mut seen = HashSet::new();
    let (mut gemms, mut fp8_gemms) = (Vec::new(), Vec::new());
    // The block's linears in FP8 where the recipe has it on (the head, router and experts stay
    // in the model dtype).
    let fp8 = r.train.fp8.linears(r.model.num_hidden_layers);
    for &tp in &tps {
        for &mb in &mbs {
            for p in projections(&r, tp, mb) {
                let elems = p.rows * p.inp + p.out * p.inp + 2 * p.rows * p.out + p.rows * p.inp;
                let bytes = (elems * dtype.size_in_bytes() + 4 * p.out * p.inp) as u64;
                if free.is_some_and(|f| bytes > f / 2) {
                    println!(
                        "{}: skipped, {:.1} GiB of operands",
                        p.what,
                        bytes as f64 / crate::plan::GIB
                    );
                    continue;
                }
                let fp8 = fp8.as_ref().filter(|_| !p.what.starts_with("head"));
                let fp8 = fp8.filter(|_| !p.what.starts_with("router"));
                let fp8 = fp8.filter(|_| !p.what.starts_with("expert"));
                let mut lists = vec![(measure(&p, dtype, &device, a.iters)?, &mut gemms)];
                if let Some(f) = fp8 {
                    let how = (f.scaling, f.gemm);
                    lists.push((
                        measure_fp8(&p, how, dtype, &device, a.iters)?,
                        &mut fp8_gemms,
                    ));
                }
                for (measured, list) in lists {
                    for g in measured {
                        if seen.insert((g.m, g.n, g.k, g.what.contains(" fp8 "))) {
                            println!(
                                "{:<32} [{} × {}] · [{} × {}]  {:9.2} TFLOP/s",
                                g.what, g.m, g.k, g.k, g.n, g.tflops
                            );
                            list.push(g);
                        }
                    }
                }
            }
        }
    }
    let mb = r.train.micro_batch;
    let attention = attention(&r, mb, &device, a.iters)?;
    println!(
        "attention {:<18} forward {:9.2} TFLOP/s, backward {:9.2} TFLOP/s",
        attention.what, attention.fwd_tflops, attention.bwd_tflops
    );
    let rows = mb * r.train.seq_len;
    let width = r.model.intermediate_size.max(r.model.hidden_size);
    let bandwidth_gbps = bandwidth((rows, width), dtype, &device, a.iters)?;
    println!("element-wise [{rows} × {width}] {bandwidth_gbps:9.1} GB/s");
    let table = Rates {
        device: crate::device::gpu_facts()
            .filter(|_| device.is_cuda())
            .map_or_else(|| "cpu".to_string(), |f| f.name),
        dtype: format!("{:?}", dtype).to_lowercase(),
        gemms,
        attention: vec![attention],
        bandwidth_gbps: Some(bandwidth_gbps),
        fp8_gemms,
    };
    if let Some(path) = &a.json_out {
        crate::files::write_replacing(path, serde_json::to_string_pretty(&table)?.as_bytes())?;
    }
    Ok(table)
}
