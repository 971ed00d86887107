//! Check 6 of `pretrain selftest`: one decoder block of the 1B recipes, its forward and its
//! hand-written backward pass, on the device in f32 and bf16 against the same block in f64 on the
//! CPU (whose gradients the tests check against autograd and finite differences).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

use super::{op_tolerance, randn, rel_error, Check};

/// The 1B recipes' decoder block (`recipes/1b.yaml`) as a one-layer model without embedding or head.
fn block_config(seq: usize) -> model::LlamaConfig {
    model::LlamaConfig {
        vocab_size: 256,
        hidden_size: 2048,
        intermediate_size: 5632,
        num_hidden_layers: 1,
        num_attention_heads: 32,
        num_key_value_heads: 4,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        max_position_embeddings: seq,
        init_std: 0.02,
        head_dim: None,
        rope_scaling: None,
        bos_token_id: None,
        eos_token_id: None,
        ..Default::default()
    }
}

/// Output, input gradient and weight gradients (by parameter name) of block 0 of `m` on `x`, the
/// gradients taken of `Σ y ∘ r`.
fn block_run(m: &model::Llama, x: &Tensor, r: &Tensor) -> Result<Vec<(String, Tensor)>> {
    let (y, tape, _) = m.block(0, x, Some(1.0), None)?;
    let (dx, grads) = m.block_backward(tape, r)?;
    let mut grads: std::collections::HashMap<usize, _> = grads.into_iter().collect();
    let mut out = vec![("output".to_string(), y), ("input".to_string(), dx)];
    for (i, p) in m.params().iter().enumerate() {
        let g = grads.remove(&i);
        let g = g.ok_or_else(|| anyhow::anyhow!("no gradient of {}", p.name))?;
        out.push((p.name.clone(), g.into_tensor()?));
    }
    Ok(out)
}

/// Check 6: the 1B decoder block on `device` in f32 and bf16 against f64 on the CPU, over `seq`
/// positions (see the module docs).
pub fn check_block(device: &Device, seq: usize) -> Result<Vec<Check>> {
    let c = block_config(seq);
    let placement = || model::Placement {
        layers: vec![0],
        embedding: false,
        head: false,
        ..model::Placement::whole(&c)
    };
    let mut checks = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let m = model::Llama::new(&c, placement(), 7, dtype, device)?;
        let reference = model::Llama::new(&c, placement(), 7, DType::F64, &Device::Cpu)?;
        for (p, q) in m.params().iter().zip(reference.params().iter()) {
            q.set(&p.tensor()?.to_device(&Device::Cpu)?.to_dtype(DType::F64)?)?;
        }
        let x = randn(&[1, seq, c.hidden_size], 41)?.to_dtype(dtype)?;
        let r = randn(&[1, seq, c.hidden_size], 42)?.to_dtype(dtype)?;
        let (xd, rd) = (x.to_device(device)?, r.to_device(device)?);
        let want = block_run(
            &reference,
            &x.to_dtype(DType::F64)?,
            &r.to_dtype(DType::F64)?,
        )?;
        let got = block_run(&m, &xd, &rd)?;
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            let what = match name.as_str() {
                "output" => "forward".to_string(),
                "input" => "grad of the input".to_string(),
                n => format!("grad of {}", n.rsplit('.').nth(1).unwrap_or(n)),
            };
            checks.push(Check {
                name: format!("1B block s={seq} {what} {dtype:?}"),
                error: rel_error(g, w)?,
                tolerance: op_tolerance(dtype),
            });
        }
    }
    Ok(checks)
}
