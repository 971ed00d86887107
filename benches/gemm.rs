//! CPU GEMM throughput of the products a training step makes (`ops::linear`'s forward `x · wᵀ`,
//! and its backward `g · w` and `gᵀ · x`), f32, through candle (the `gemm` crate), on the
//! projection shapes of the tiny recipe and of a larger CPU model (hidden 512, intermediate 1536,
//! 8 × 512 tokens). `bench/gemm_cpu.sh` runs it beside NumPy (OpenBLAS) on the same shapes.
//!
//! Run: `cargo bench --bench gemm -- [repeats]`; prints one JSON line: GFLOP/s by product.

use std::time::Instant;

use candle_core::{Device, Tensor};

#[global_allocator]
static GLOBAL: pretrain::Allocator = pretrain::Allocator {};

/// `(name, rows, in, out)` of a projection.
const SHAPES: [(&str, usize, usize, usize); 4] = [
    ("tiny qkv/o", 1024, 128, 128),
    ("tiny mlp up", 1024, 128, 384),
    ("cpu512 o", 4096, 512, 512),
    ("cpu512 mlp up", 4096, 512, 1536),
];

/// Median seconds of `repeats` runs of `f` after one warm-up run.
fn median_s(
    repeats: usize,
    mut f: impl FnMut() -> candle_core::Result<Tensor>,
) -> anyhow::Result<f64> {
    f()?;
    let mut t: Vec<f64> = (0..repeats)
        .map(|_| {
            let start = Instant::now();
            f().map(|_| start.elapsed().as_secs_f64())
        })
        .collect::<candle_core::Result<_>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn main() -> anyhow::Result<()> {
    pretrain::process_defaults();
    let repeats: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map_or(Ok(20), |s| s.parse())?;
    let dev = Device::Cpu;
    let mut out = serde_json::Map::new();
    for (name, rows, n_in, n_out) in SHAPES {
        let x = Tensor::randn(0f32, 1.0, (rows, n_in), &dev)?;
        let w = Tensor::randn(0f32, 1.0, (n_out, n_in), &dev)?;
        let g = Tensor::randn(0f32, 1.0, (rows, n_out), &dev)?;
        let flops = 2.0 * (rows * n_in * n_out) as f64;
        let fwd = median_s(repeats, || x.matmul(&w.t()?))?; // [rows, out]
        let dx = median_s(repeats, || g.matmul(&w))?; // [rows, in]
        let dw = median_s(repeats, || g.t()?.matmul(&x))?; // [out, in]
        out.insert(
            name.to_string(),
            serde_json::json!({
                "rows": rows, "in": n_in, "out": n_out,
                "fwd_gflops": flops / fwd / 1e9,
                "dx_gflops": flops / dx / 1e9,
                "dw_gflops": flops / dw / 1e9,
            }),
        );
    }
    println!("{}", serde_json::Value::Object(out));
    Ok(())
}
