//! Check 2: the optimizer's flat-buffer kernels (gradient accumulation, the AdamW update with
//! fp32 and bf16 moments, sums of squares, the masters cast into the parameters, by a pass of
//! their own and by the update itself, the fused
//! weight-gradient product) and Muon's Newton-Schulz iteration on the device against the CPU.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

use super::{op_tolerance, randn, rel_error, Check};
use crate::optim::kernels::{
    add_into, add_product_into, cast_into, sum_squares, sum_squares_of, write_into,
    write_product_into, AdamWStep, NonFinite,
};

/// The checks' AdamW step over `n` elements (two decay ranges, a clipping scale), with
/// `moments` and, on CUDA, the bf16 `params` it also writes.
fn step_of(n: usize, moments: DType, dev: &Device, params: Option<Tensor>) -> Result<AdamWStep> {
    Ok(AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        step: 3,
        grad_scale: 0.5,
        decay: vec![(0, n / 2, 0.1), (n / 2, n - n / 2, 0.0)],
        moments,
        nonfinite: NonFinite::on(dev)?,
        params,
    })
}

/// Check 2: the optimizer's flat-buffer kernels on `device` against the CPU.
pub fn check_flat_kernels(device: &Device) -> Result<Vec<Check>> {
    let n = 10_007;
    let mut checks = Vec::new();
    let grad = randn(&[n], 21)?.to_dtype(DType::F32)?;
    let master = randn(&[n], 22)?.to_dtype(DType::F32)?;
    let moments = randn(&[2 * n], 27)?.abs()?;
    // The state words of each moment dtype: f32 moments, or bf16 ones two to a word.
    let state_of = |dtype: DType| -> Result<Tensor> {
        let words = match dtype {
            DType::BF16 => {
                let m = moments.to_dtype(DType::BF16)?.to_vec1::<half::bf16>()?;
                Tensor::new(bytemuck::cast_slice::<half::bf16, f32>(&m), &Device::Cpu)?
            }
            _ => moments.to_dtype(DType::F32)?,
        };
        Ok(Tensor::cat(&[&master, &words], 0)?)
    };
    let run = |dev: &Device| -> Result<(Tensor, Vec<Tensor>, [f64; 2])> {
        let acc = randn(&[n], 23)?.to_dtype(DType::F32)?.to_device(dev)?;
        add_into(&acc, &grad.to_dtype(DType::BF16)?.to_device(dev)?)?;
        let mut states = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            let st = state_of(dtype)?.to_device(dev)?;
            let op = step_of(n, dtype, dev, None)?;
            st.inplace_op2(&grad.to_device(dev)?, &op)?;
            if op.nonfinite.take()? {
                anyhow::bail!("adamw on {dev:?}: a finite update set the non-finite flag");
            }
            states.push(st);
        }
        let packed = sum_squares_of(&states[1].narrow(0, n, n)?, DType::BF16)?;
        Ok((acc.clone(), states, [sum_squares(&acc)?, packed]))
    };
    let (acc_d, st_d, ss_d) = run(device)?;
    let (acc_c, st_c, ss_c) = run(&Device::Cpu)?;
    let exact = 1e-6;
    checks.push(Check {
        name: "add_into (bf16 gradient into f32)".into(),
        error: rel_error(&acc_d, &acc_c)?,
        tolerance: exact,
    });
    checks.push(Check {
        name: "adamw step".into(),
        error: rel_error(&st_d[0], &st_c[0])?,
        tolerance: exact,
    });
    // bf16 moments: the master weights as above, the packed moments' words bit for bit.
    let differing = |a: &Tensor, b: &Tensor| -> Result<f64> {
        let (a, b) = (a.to_vec1::<f32>()?, b.to_vec1::<f32>()?);
        let bad = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits());
        Ok(bad.count() as f64 / a.len().max(1) as f64)
    };
    checks.push(Check {
        name: "adamw step, bf16 moments".into(),
        error: rel_error(&st_d[1].narrow(0, 0, n)?, &st_c[1].narrow(0, 0, n)?)?.max(differing(
            &st_d[1].narrow(0, n, n)?,
            &st_c[1].narrow(0, n, n)?,
        )?),
        tolerance: exact,
    });
    for (i, what) in ["sum_squares", "sum_squares of packed bf16"]
        .iter()
        .enumerate()
    {
        checks.push(Check {
            name: what.to_string(),
            error: (ss_d[i] - ss_c[i]).abs() / ss_c[i],
            tolerance: 1e-12,
        });
    }
    // The masters written into a view of bf16 parameters (cast in place), against the CPU's
    // cast bit for bit.
    let cast = |dev: &Device| -> Result<Tensor> {
        let params = Tensor::zeros(n + 8, DType::BF16, dev)?;
        cast_into(&params.narrow(0, 3, n)?, &master.to_device(dev)?)?;
        Ok(params.to_device(&Device::Cpu)?)
    };
    let (on_device, on_cpu) = (cast(device)?, cast(&Device::Cpu)?);
    let differs = on_device
        .to_dtype(DType::F32)?
        .ne(&on_cpu.to_dtype(DType::F32)?)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    checks.push(Check {
        name: "cast_into (f32 masters into bf16 parameters)".into(),
        error: differs as f64 / n as f64,
        tolerance: 0.0,
    });
    // The update writing the bf16 parameters as it stores the masters (CUDA; the CPU casts
    // after it), against the CPU's update and cast bit for bit.
    let written = |dev: &Device| -> Result<Tensor> {
        let st = state_of(DType::F32)?.to_device(dev)?;
        let params = Tensor::zeros(n, DType::BF16, dev)?;
        let op = step_of(n, DType::F32, dev, dev.is_cuda().then(|| params.clone()))?;
        st.inplace_op2(&grad.to_device(dev)?, &op)?;
        if !dev.is_cuda() {
            cast_into(&params, &st.narrow(0, 0, n)?)?;
        }
        Ok(params.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)
    };
    let (on_device, on_cpu) = (written(device)?, written(&Device::Cpu)?);
    let differs = on_device.ne(&on_cpu)?.to_dtype(DType::F32)?.sum_all()?;
    checks.push(Check {
        name: "adamw writing bf16 parameters as it updates".into(),
        error: differs.to_scalar::<f32>()? as f64 / n as f64,
        tolerance: 0.0,
    });
    // A weight gradient's product accumulated into the buffer, against f64 on the CPU from the
    // same (rounded) values. Sums of 1000 products in f32: 1e-5. bf16 factors on the CPU take
    // the unfused path, whose product is rounded to bf16 before it is added (op tolerance).
    let (rows, out, inp) = (1000, 96, 80);
    for dtype in [DType::F32, DType::BF16] {
        let acc = randn(&[out * inp], 24)?.to_dtype(DType::F32)?;
        let g = randn(&[rows, out], 25)?.to_dtype(dtype)?;
        let x = randn(&[rows, inp], 26)?.to_dtype(dtype)?;
        let f64s = |t: &Tensor| t.to_dtype(DType::F64);
        let want = (f64s(&acc)? + f64s(&g)?.t()?.matmul(&f64s(&x)?)?.flatten_all()?)?;
        let got = acc.to_device(device)?; // the same storage as `acc` on the CPU
        add_product_into(&got, &g.to_device(device)?, &x.to_device(device)?)?;
        let fused = device.is_cuda() || dtype == DType::F32;
        checks.push(Check {
            name: format!("add_product_into ({dtype:?} factors into f32)"),
            error: rel_error(&got.to_dtype(DType::F64)?, &want)?,
            tolerance: if fused { 1e-5 } else { op_tolerance(dtype) },
        });
    }
    // A step's first gradients written over the slot's old values (NaN here; GEMM beta = 0, a
    // copy with cast), against the same gradients added onto zeros: no old value read, the same
    // sums (cuBLAS may pick another kernel for beta = 0, so within f32's rounding of a sum).
    let (rows, out, inp) = (300, 48, 40);
    let g = randn(&[rows, out], 31)?
        .to_dtype(DType::BF16)?
        .to_device(device)?;
    let x = randn(&[rows, inp], 32)?
        .to_dtype(DType::BF16)?
        .to_device(device)?;
    let t = randn(&[out * inp], 33)?
        .to_dtype(DType::BF16)?
        .to_device(device)?;
    let onto = |nan: bool| -> Result<Tensor> {
        let fill = if nan { f32::NAN } else { 0.0 };
        let buf = Tensor::full(fill, 2 * out * inp, device)?;
        let (a, b) = (
            buf.narrow(0, 0, out * inp)?,
            buf.narrow(0, out * inp, out * inp)?,
        );
        match nan {
            true => {
                write_product_into(&a, &g, &x)?;
                write_into(&b, &t)?;
            }
            false => {
                add_product_into(&a, &g, &x)?;
                add_into(&b, &t)?;
            }
        }
        Ok(buf.to_device(&Device::Cpu)?)
    };
    checks.push(Check {
        name: "first gradients written over old values (beta 0) as onto zeros".into(),
        error: rel_error(&onto(true)?, &onto(false)?)?,
        tolerance: 1e-6,
    });
    // Muon's iteration: bf16 with f32 accumulation on a GPU (as torch's Muon), f32 on the CPU;
    // against f32 on the CPU, a wide and a tall matrix. bf16 rounds each of the 5 steps'
    // products once (`addmm`; torch's bf16 against its f32 steps: 1.3e-2 relative).
    let cfg = crate::recipe::MuonConfig::default();
    for shape in [[96, 160], [160, 96]] {
        let g = randn(&shape, 28)?.to_dtype(DType::F32)?;
        let ns = crate::optim::muon::newton_schulz;
        let on_device = ns(
            &g.to_device(device)?,
            &cfg,
            crate::optim::muon::compute_dtype(device),
        )?;
        let want = ns(&g, &cfg, DType::F32)?;
        checks.push(Check {
            name: format!("muon newton-schulz {}x{}", shape[0], shape[1]),
            error: rel_error(&on_device.to_device(&Device::Cpu)?, &want)?,
            tolerance: if device.is_cuda() { 3e-2 } else { exact },
        });
    }
    Ok(checks)
}
