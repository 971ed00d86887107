//! Check 11 of `pretrain selftest`: what the fused projections add on the device. The SwiGLU on
//! the fused gate/up GEMM's joined output, forward and backward, against the halves' SwiGLU on
//! the same device bit for bit; a weight gradient accumulated from a range of a wider
//! gradient's columns (rows `2f` apart, read in place) against f64.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use model::ops::{swiglu, swiglu_bwd, swiglu_joined, swiglu_joined_bwd};

use super::{randn, rel_error, Check};
use crate::optim::kernels::add_product_into;

/// Check 11 on `device`.
pub fn check_fused(device: &Device) -> Result<Vec<Check>> {
    let (rows, f, inp) = (300, 72, 40);
    let mut checks = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let on = |t: Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_device(device)?) };
        let gu = on((randn(&[rows, 2 * f], 60)? * 3.0)?)?; // [rows, 2f]
        let dy = on(randn(&[rows, f], 61)?)?;
        let (gate, up) = (
            gu.narrow(1, 0, f)?.contiguous()?,
            gu.narrow(1, f, f)?.contiguous()?,
        );
        let (dg, du) = swiglu_bwd(&gate, &up, &dy)?;
        let joined = swiglu_joined_bwd(&gu, &dy)?;
        let apart = Tensor::cat(&[&dg, &du], 1)?;
        for (what, got, want) in [
            ("forward", swiglu_joined(&gu)?, swiglu(&gate, &up)?),
            ("backward", joined, apart),
        ] {
            checks.push(Check {
                name: format!("swiglu joined {what} {dtype:?}"),
                error: differing(&got, &want)?,
                tolerance: 0.0,
            });
        }
        // d gate's columns of the joined gradient as the factor of its weight gradient.
        let x = on(randn(&[rows, inp], 62)?)?;
        let g = gu.narrow(1, 0, f)?; // [rows, f], rows 2f apart
        let acc = Tensor::zeros(f * inp, DType::F32, device)?;
        add_product_into(&acc, &g, &x)?;
        let f64s = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F64);
        let want = f64s(&g)?.t()?.matmul(&f64s(&x)?)?.flatten_all()?;
        let fused = device.is_cuda() || dtype == DType::F32;
        checks.push(Check {
            name: format!("add_product_into, g rows 2f apart ({dtype:?})"),
            error: rel_error(&acc.to_dtype(DType::F64)?, &want)?,
            tolerance: if fused {
                1e-5
            } else {
                super::op_tolerance(dtype)
            },
        });
    }
    Ok(checks)
}

/// The share of elements of `a` and `b` whose bits differ.
fn differing(a: &Tensor, b: &Tensor) -> Result<f64> {
    let bits = |t: &Tensor| -> Result<Vec<u64>> {
        let v = t
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F64)?
            .flatten_all()?;
        Ok(v.to_vec1::<f64>()?.iter().map(|x| x.to_bits()).collect())
    };
    let (a, b) = (bits(a)?, bits(b)?);
    if a.len() != b.len() {
        anyhow::bail!("{} elements against {}", a.len(), b.len());
    }
    let bad = a.iter().zip(&b).filter(|(x, y)| x != y).count();
    Ok(bad as f64 / a.len().max(1) as f64)
}
