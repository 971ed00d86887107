//! Check 10 of `pretrain selftest`: the experts' grouped linears (one grouped cuBLAS call on a
//! GPU) on the device against the CPU's per-run products, forward and input gradient, f32 and
//! bf16, with an empty run among uneven ones; and the index tables of padded routing, made on
//! the device, against the CPU's.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use model::ops::{grouped_linear, Grouped};

use super::{op_tolerance, randn, rel_error, Check};

/// Check 10 on `device`.
pub fn check_grouped(device: &Device) -> Result<Vec<Check>> {
    let counts = [37, 0, 130, 1, 88];
    let m: usize = counts.iter().sum();
    let (out, inp) = (96, 64);
    let mut checks = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let ws: Vec<Tensor> = (0..counts.len())
            .map(|e| Ok((randn(&[out, inp], 40 + e as u64)? * 0.1)?.to_dtype(dtype)?))
            .collect::<Result<_>>()?;
        let on: Vec<Tensor> = ws
            .iter()
            .map(|w| w.to_device(device))
            .collect::<Result<_, _>>()?;
        let (cpu_w, dev_w): (Vec<&Tensor>, Vec<&Tensor>) =
            (ws.iter().collect(), on.iter().collect());
        for (kind, width) in [(Grouped::Forward, inp), (Grouped::InputGrad, out)] {
            let x = randn(&[m, width], 50)?.to_dtype(dtype)?;
            let want = grouped_linear(&x, &counts, &cpu_w, kind)?;
            let got = grouped_linear(&x.to_device(device)?, &counts, &dev_w, kind)?;
            checks.push(Check {
                name: format!("grouped linear {kind:?} {dtype:?}"),
                error: rel_error(&got, &want)?,
                tolerance: op_tolerance(dtype),
            });
        }
    }
    checks.push(check_padded_routing(device)?);
    Ok(checks)
}

/// Padded routing's tables (`model::moe::padded_tables`) on `device` against the CPU's, for
/// 9,000 tokens, top-2 of 8 experts at capacity factor 1.25: 18,000 pairs, so the prefix sums
/// run over three levels of blocks. The error is the share of entries that differ (none may).
fn check_padded_routing(device: &Device) -> Result<Check> {
    use candle_core::D;
    let (n, e, k) = (9000, 8, 2);
    let capacity = (1.25 * (n * k) as f64 / e as f64).ceil() as usize;
    // Softmax of random logits: no two probabilities of a row are equal.
    let probs = softmax(&randn(&[n, e], 60)?)?;
    let want = model::moe::padded_tables(&probs, k, capacity)?;
    let got = model::moe::padded_tables(&probs.to_device(device)?, k, capacity)?;
    let (mut differ, mut total) = (0usize, 0usize);
    for (w, g) in want.iter().zip(&got) {
        let (w, g) = (
            w.to_dtype(DType::F64)?.flatten_all()?,
            g.to_device(&Device::Cpu)?
                .to_dtype(DType::F64)?
                .flatten_all()?,
        );
        differ += w
            .ne(&g)?
            .to_dtype(DType::F64)?
            .sum(D::Minus1)?
            .to_scalar::<f64>()? as usize;
        total += w.elem_count();
    }
    Ok(Check {
        name: "padded MoE routing tables on the device".into(),
        error: differ as f64 / total as f64,
        tolerance: 0.0,
    })
}

/// Softmax over the last dimension of `x` `[n, e]`.
fn softmax(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(1)?;
    let ex = x.broadcast_sub(&max)?.exp()?;
    Ok(ex.broadcast_div(&ex.sum_keepdim(1)?)?)
}
