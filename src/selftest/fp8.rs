//! Check 9 of `pretrain selftest`: FP8 rounding by block on the device against the CPU, bit for
//! bit (f32 and bf16, both formats, the four block shapes), a linear of rounded operands, the
//! three FP8 GEMMs of a linear (cuBLASLt on CUDA) against f64 with tensorwise and with blockwise
//! scales, and operands quantized once for several GEMMs against the one-call GEMMs.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use model::ops::{
    fp8_add_product_into, fp8_linear, fp8_linear_dx, fp8_linear_dx_of, fp8_linear_of,
    fp8_product_factors, fp8_round, linear, Fp8Blocks, Fp8Format, Fp8Operand, Fp8Quant,
};

use super::{op_tolerance, randn, rel_error, Check};

/// The share of elements of `a` and `b` whose bits differ.
fn differing(a: &Tensor, b: &Tensor) -> Result<f64> {
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        let v = t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        Ok(v.flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect())
    };
    let (a, b) = (bits(a)?, bits(b)?);
    let bad = a.iter().zip(&b).filter(|(x, y)| x != y).count();
    Ok(bad as f64 / a.len().max(1) as f64)
}

/// Check 9 on `device`.
pub fn check_fp8(device: &Device) -> Result<Vec<Check>> {
    let mut checks = Vec::new();
    // [300, 260]: edge blocks cut short both ways; a few outliers.
    let spikes = (randn(&[300, 260], 31)?
        .abs()?
        .ge(2.8)?
        .to_dtype(DType::F32)?
        * 400.0)?;
    let x = (randn(&[300, 260], 30)?.to_dtype(DType::F32)? * (spikes + 1.0)?)?;
    for dtype in [DType::F32, DType::BF16] {
        let x = x.to_dtype(dtype)?;
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for blocks in [
                Fp8Blocks::Tensor,
                Fp8Blocks::Rows,
                Fp8Blocks::Cols,
                Fp8Blocks::Tiles,
            ] {
                let q = Fp8Quant { format, blocks };
                let got = fp8_round(&x.to_device(device)?, q)?;
                checks.push(Check {
                    name: format!("fp8_round {dtype:?} {format:?} {blocks:?}"),
                    error: differing(&got, &fp8_round(&x, q)?)?,
                    tolerance: 0.0,
                });
            }
        }
    }
    // The emulated FP8 linear: bf16 operands rounded (1 x 128 activations, 128 x 128 weights)
    // and multiplied on the device, against f64 from the CPU's rounded operands.
    let a = randn(&[256, 384], 32)?.to_dtype(DType::BF16)?;
    let w = (randn(&[320, 384], 33)? * 0.05)?.to_dtype(DType::BF16)?;
    let (qa, qw) = (
        Fp8Quant {
            format: Fp8Format::E4M3,
            blocks: Fp8Blocks::Rows,
        },
        Fp8Quant {
            format: Fp8Format::E4M3,
            blocks: Fp8Blocks::Tiles,
        },
    );
    let on_device = linear(
        &fp8_round(&a.to_device(device)?, qa)?,
        &fp8_round(&w.to_device(device)?, qw)?,
    )?;
    let f64s = |t: Tensor| t.to_dtype(DType::F64);
    let want = f64s(fp8_round(&a, qa)?)?.matmul(&f64s(fp8_round(&w, qw)?)?.t()?)?;
    checks.push(Check {
        name: "fp8 linear (emulated, bf16) against f64".into(),
        error: rel_error(
            &on_device.to_device(&Device::Cpu)?.to_dtype(DType::F64)?,
            &want,
        )?,
        tolerance: op_tolerance(DType::BF16),
    });
    checks.extend(check_fp8_gemms(device)?);
    checks.extend(check_fp8_blockwise_gemms(device)?);
    Ok(checks)
}

/// The three FP8 GEMMs of a blockwise linear (cuBLASLt's `VEC128_32F` and `BLK128x128_32F`
/// scales on CUDA; the rounded values multiplied on the CPU) against f64 products of the CPU's
/// rounded operands: `x` and `g` by 1 × 128 blocks, `w` by 128 × 128 tiles (its transposed codes
/// for the input gradient), and the weight gradient's factors by 128 × 1 blocks. K of 384 runs
/// a grid of tiles three wide.
fn check_fp8_blockwise_gemms(device: &Device) -> Result<Vec<Check>> {
    let (rows, out, inp) = (256, 256, 384);
    let x = randn(&[rows, inp], 38)?.to_dtype(DType::BF16)?;
    let w = (randn(&[out, inp], 39)? * 0.05)?.to_dtype(DType::BF16)?;
    let g = (randn(&[rows, out], 40)? * 1e-3)?.to_dtype(DType::BF16)?;
    let (xd, wd, gd) = (
        x.to_device(device)?,
        w.to_device(device)?,
        g.to_device(device)?,
    );
    let q = |format, blocks| Fp8Quant { format, blocks };
    let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
    use Fp8Blocks::{Cols, Rows, Tiles};
    let rounded =
        |t: &Tensor, quant| -> Result<Tensor> { Ok(fp8_round(t, quant)?.to_dtype(DType::F64)?) };
    let back =
        |t: &Tensor| -> Result<Tensor> { Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?) };
    let w_op = Fp8Operand::codes(&wd, inp, e4, (Some(Tiles), Some(Tiles)))?;
    let x_op = Fp8Operand::codes(&xd, inp, e4, (Some(Rows), None))?;
    let g_op = Fp8Operand::codes(&gd, out, e5, (Some(Rows), None))?;
    let (xr, wr, gr) = (
        rounded(&x, q(e4, Rows))?,
        rounded(&w, q(e4, Tiles))?,
        rounded(&g, q(e5, Rows))?,
    );
    let y = back(&fp8_linear_of(&x_op, &w_op, (rows, out))?)?;
    let dx = back(&fp8_linear_dx_of(&w_op, &g_op, x.shape())?)?;
    let mut checks = vec![
        Check {
            name: "fp8 GEMM forward (blockwise) against f64".into(),
            error: rel_error(&y, &xr.matmul(&wr.t()?)?)?,
            tolerance: 1e-2,
        },
        Check {
            name: "fp8 GEMM input gradient (blockwise) against f64".into(),
            error: rel_error(&dx, &gr.matmul(&wr)?)?,
            tolerance: 1e-2,
        },
    ];
    let g_tok = Fp8Operand::codes(&gd, out, e5, (None, Some(Cols)))?;
    let x_tok = Fp8Operand::codes(&xd, inp, e4, (None, Some(Cols)))?;
    let dst = Tensor::zeros(out * inp, DType::F32, device)?;
    crate::optim::kernels::add_fp8_product_into(&dst, &g_tok, &x_tok, false)?;
    let want = rounded(&g, q(e5, Cols))?
        .t()?
        .matmul(&rounded(&x, q(e4, Cols))?)?;
    checks.push(Check {
        name: "fp8 GEMM weight gradient (blockwise, into f32) against f64".into(),
        error: rel_error(&back(&dst)?, &want.flatten_all()?)?,
        // A GPU's FP8 tensor cores sum with fewer bits than f32 between promotions (measured on
        // an H200: 2.6e-4, fast accumulation off); bf16 factors on the CPU round their product
        // to bf16 first.
        tolerance: if device.is_cuda() {
            1e-3
        } else {
            op_tolerance(DType::BF16)
        },
    });
    Ok(checks)
}

/// The three FP8 GEMMs of a tensorwise linear (cuBLASLt on CUDA; the rounded values multiplied
/// on the CPU) against f64 products of the CPU's rounded operands: the forward and the input
/// gradient rounded once to bf16, the weight gradient accumulated in f32 onto a prior.
fn check_fp8_gemms(device: &Device) -> Result<Vec<Check>> {
    let (rows, out, inp) = (256, 192, 320);
    let x = randn(&[rows, inp], 34)?.to_dtype(DType::BF16)?;
    let w = (randn(&[out, inp], 35)? * 0.05)?.to_dtype(DType::BF16)?;
    let g = (randn(&[rows, out], 36)? * 1e-3)?.to_dtype(DType::BF16)?;
    let on = |t: &Tensor| t.to_device(device);
    let f64s = |t: Tensor| t.to_dtype(DType::F64);
    let back =
        |t: Tensor| -> Result<Tensor> { Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?) };
    let tensor = |format| Fp8Quant {
        format,
        blocks: Fp8Blocks::Tensor,
    };
    let xq = f64s(fp8_round(&x, tensor(Fp8Format::E4M3))?)?;
    let wq = f64s(fp8_round(&w, tensor(Fp8Format::E4M3))?)?;
    let gq = f64s(fp8_round(&g, tensor(Fp8Format::E5M2))?)?;
    let mut checks = Vec::new();
    // bf16 outputs (2^-9) after FP8 products summed in f32 (the forward's fast accumulation).
    let y = back(fp8_linear(&on(&x)?, &on(&w)?, (rows, out))?)?;
    checks.push(Check {
        name: "fp8 GEMM forward (tensorwise) against f64".into(),
        error: rel_error(&y, &xq.matmul(&wq.t()?)?)?,
        tolerance: 1e-2,
    });
    let dx = back(fp8_linear_dx(&on(&w)?, &on(&g)?, x.shape())?)?;
    checks.push(Check {
        name: "fp8 GEMM input gradient against f64".into(),
        error: rel_error(&dx, &gq.matmul(&wq)?)?,
        tolerance: 1e-2,
    });
    // Operands made once: a weight's codes as laid out and transposed in one pass, read by
    // both GEMMs, and an input read by two linears, give the one-call products bit for bit.
    let (xd, wd, gd) = (on(&x)?, on(&w)?, on(&g)?);
    let tensor = Some(Fp8Blocks::Tensor);
    let w_op = Fp8Operand::codes(&wd, inp, Fp8Format::E4M3, (tensor, tensor))?;
    let x_op = Fp8Operand::codes(&xd, inp, Fp8Format::E4M3, (tensor, None))?;
    let g_op = Fp8Operand::codes(&gd, out, Fp8Format::E5M2, (tensor, None))?;
    let shared = [
        fp8_linear_of(&x_op, &w_op, (rows, out))?,
        fp8_linear_of(&x_op, &w_op, (rows, out))?,
    ];
    let one_call = fp8_linear(&xd, &wd, (rows, out))?;
    let dx_shared = fp8_linear_dx_of(&w_op, &g_op, x.shape())?;
    let dx_one_call = fp8_linear_dx(&wd, &gd, x.shape())?;
    checks.push(Check {
        name: "fp8 operands made once against one-call GEMMs (bits differing)".into(),
        error: differing(&shared[0], &one_call)?
            .max(differing(&shared[1], &one_call)?)
            .max(differing(&dx_shared, &dx_one_call)?),
        tolerance: 0.0,
    });
    let prior = (randn(&[out * inp], 37)? * 1e-3)?.to_dtype(DType::F32)?;
    let want = (f64s(prior.clone())? + gq.t()?.matmul(&xq)?.flatten_all()?)?;
    let dst = on(&prior.copy()?)?;
    if device.is_cuda() {
        fp8_add_product_into(&dst, &on(&g)?, &on(&x)?)?;
    } else {
        let (gr, xr) = fp8_product_factors(&g, &x)?;
        crate::optim::kernels::add_product_into(&dst, &gr, &xr)?;
    }
    checks.push(Check {
        name: "fp8 GEMM weight gradient (into f32) against f64".into(),
        error: rel_error(&back(dst)?, &want)?,
        // A GPU's FP8 tensor cores sum with fewer bits than f32 between promotions (measured on
        // an H200: 2.2e-4, fast accumulation off); bf16 factors on the CPU round their product
        // to bf16 first.
        tolerance: if device.is_cuda() {
            1e-3
        } else {
            op_tolerance(DType::BF16)
        },
    });
    Ok(checks)
}
