//! The export's parity gate: the exported files, loaded back, must give the checkpoint's logits.
//! Both sides run piece by piece (one piece of the model built, loaded and run at a time), so
//! the gate holds one piece's weights, not the model, whatever its size.

use std::path::Path;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use ckpt::{Checkpoint, Kind};
use half::bf16;
use model::{Llama, LlamaConfig, Placement};

use super::HfWeights;
use crate::recipe::Dtype;
use crate::train::checkpoint::tensor_block;

/// The exported files, loaded back, give the checkpoint's logits (with the checkpoint's weights
/// rounded to the export dtype) within 1e-5 relative; returns the difference. Both sides run
/// piece by piece ([`streamed_logits`]): one piece's weights are alive at a time.
pub(super) fn gate(ck: &Checkpoint, c: &LlamaConfig, out: &Path, dtype: Dtype) -> Result<f64> {
    let round = |v: Vec<f32>| match dtype {
        Dtype::F32 => v,
        Dtype::Bf16 => v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect(),
    };
    let tokens = tokens(c)?;
    let expected = streamed_logits(c, &tokens, |p| {
        Ok(round(ck.read_block(Kind::Master, tensor_block(p))?))
    })?;
    let hf = HfWeights::open(out)?;
    let got = streamed_logits(c, &tokens, |p| hf.get(&p.name, &p.global_shape))?;
    let scale = expected.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-12) as f64;
    let parity = (&expected - &got)?.abs()?.max_all()?.to_scalar::<f32>()? as f64 / scale;
    // A maximum may pass over NaN; the sums cannot.
    let finite = |t: &Tensor| -> Result<bool> {
        Ok(t.to_dtype(candle_core::DType::F64)?
            .sum_all()?
            .to_scalar::<f64>()?
            .is_finite())
    };
    if !finite(&expected)? || !finite(&got)? {
        bail!("export parity gate failed: the logits of the checkpoint or of the exported model are not finite");
    }
    if parity.is_nan() || parity > 1e-5 {
        bail!("export parity gate failed: logits of the exported model differ from the checkpoint's by {parity:.3e} (relative)");
    }
    Ok(parity)
}

/// The full logits of `tokens` (f32, on the CPU) under the weights `load` gives, one piece of
/// the model built, loaded and run at a time.
fn streamed_logits(
    c: &LlamaConfig,
    tokens: &Tensor,
    mut load: impl FnMut(&model::Parameter) -> Result<Vec<f32>>,
) -> Result<Tensor> {
    let mut x = tokens.clone();
    for piece in Placement::whole(c).pieces() {
        let m = Llama::new(
            c,
            Placement::of_piece(c, piece),
            0,
            DType::F32,
            &Device::Cpu,
        )?;
        m.load_weights(&mut load)?;
        x = m.logits_forward(piece, &x)?;
    }
    Ok(x)
}

/// Two fixed sequences of up to 32 tokens for the parity gate.
fn tokens(c: &LlamaConfig) -> Result<Tensor> {
    let s = c.max_position_embeddings.min(32);
    let ids: Vec<u32> = (0..2 * s as u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) % c.vocab_size as u32)
        .collect();
    Ok(Tensor::from_vec(ids, (2, s), &Device::Cpu)?)
}
