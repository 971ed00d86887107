//! Check 10 of `pretrain selftest`: the experts' grouped linears (one grouped cuBLAS call on a
//! GPU) on the device against the CPU's per-run products, forward and input gradient, f32 and
//! bf16, with an empty run among uneven ones.

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
    Ok(checks)
}
