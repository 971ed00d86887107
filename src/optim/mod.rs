//! The optimizer side of a step: persistent flat fp32 gradient buffers, AdamW with fp32 master
//! weights and moments over the flat ranges a rank owns (everything, or its ZeRO-1 shards),
//! weight-decay masks and global-norm clipping; Muon for the hidden matrices
//! (`optimizer.name: muon`), and the rank's [`Optimizer`] holding either; AdamW's state in
//! host memory with `optimizer.offload: cpu` (`offload.rs`).

mod adamw;
mod grads;
pub mod kernels;
pub mod muon;
pub mod offload;
mod optimizer;
pub mod spans;

pub use adamw::AdamW;
#[cfg(test)]
pub use adamw::AdamWState;
pub use grads::GradBuffer;
pub use muon::Muon;
pub use optimizer::Optimizer;
pub use parallel::dp::FlatLayout;

use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};
use model::ParamSet;
use parallel::dp::intersect;

/// The layout of `params` in buckets of at least `bucket_size` elements, padded for `dp_size`
/// data-parallel ranks.
pub fn layout_of(params: &ParamSet, bucket_size: usize, dp_size: usize) -> FlatLayout {
    let numels: Vec<usize> = params.iter().map(|p| p.numel()).collect();
    FlatLayout::new(&numels, bucket_size, dp_size)
}

/// All parameters as one flat f32 vector `[layout.total]` (padding zero).
pub fn flatten_params(params: &ParamSet, layout: &FlatLayout) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(2 * params.len());
    let mut end = 0;
    for (i, p) in params.iter().enumerate() {
        let r = layout.range(i);
        if r.start > end {
            parts.push(Tensor::zeros(r.start - end, DType::F32, &p.device)?);
        }
        parts.push(p.tensor()?.to_dtype(DType::F32)?.flatten_all()?);
        end = r.end;
    }
    if let (true, Some(p)) = (layout.total > end, params.iter().next()) {
        parts.push(Tensor::zeros(layout.total - end, DType::F32, &p.device)?);
    }
    Tensor::cat(&parts, 0)
}

/// The initial values (run seed `seed`) of the flat ranges `owned` of `layout`, one after the
/// other as f32 `[Σ len]` on `device` (padding zero), rounded through each parameter's dtype as
/// [`flatten_params`] of a freshly built model would give them — without building the
/// parameters: each range costs only its own rows (ZeRO-3's start-up).
pub fn initial_owned(
    params: &ParamSet,
    layout: &FlatLayout,
    owned: &[Range<usize>],
    seed: u64,
    device: &Device,
) -> Result<Tensor> {
    let mut out: Vec<f32> = Vec::with_capacity(owned.iter().map(|r| r.len()).sum());
    for r in owned {
        let mut at = r.start;
        for (i, p) in params.iter().enumerate() {
            let slot = layout.range(i);
            let cut = intersect(&slot, r);
            if cut.is_empty() {
                continue;
            }
            out.resize(out.len() + (cut.start - at), 0.0); // padding before it
            let local = cut.start - slot.start..cut.end - slot.start;
            let values = p.initial_values(seed, local);
            let n = values.len();
            let rounded = Tensor::from_vec(values, n, &Device::Cpu)?
                .to_dtype(p.dtype)?
                .to_dtype(DType::F32)?;
            out.extend(rounded.to_vec1::<f32>()?);
            at = cut.end;
        }
        out.resize(out.len() + (r.end - at), 0.0);
    }
    let n = out.len();
    Tensor::from_vec(out, n, device)
}

/// Copies the parameters' values at the flat ranges `owned` of `layout` into the front of
/// `dst` (f32, on their device or the host), the ranges back to back, one parameter slice at a time (start-up holds one
/// parameter's f32 copy at most; padding is left as it is).
pub(crate) fn copy_owned(
    params: &ParamSet,
    layout: &FlatLayout,
    owned: &[Range<usize>],
    dst: &Tensor,
) -> Result<()> {
    let mut base = 0; // where range `r` starts in `dst`
    for r in owned {
        for (i, p) in params.iter().enumerate() {
            let slot = layout.range(i);
            let cut = intersect(&slot, r);
            if cut.is_empty() {
                continue;
            }
            let part = p
                .tensor()?
                .flatten_all()?
                .narrow(0, cut.start - slot.start, cut.len())?
                .to_dtype(DType::F32)?
                .to_device(dst.device())?; // to the host when the state is offloaded
            dst.slice_set(&part, 0, base + cut.start - r.start)?;
        }
        base += r.len();
    }
    Ok(())
}

/// Packs `params` (all installed) into one flat tensor at `layout`'s offsets, so that
/// [`write_params`] writes them in one pass.
pub fn pack_params(params: &ParamSet, layout: &FlatLayout) -> Result<()> {
    params.pack_at(&layout.offsets, layout.total)
}

/// Writes a whole flat f32 vector `[layout.total]` into the parameters (cast to their dtype).
pub fn write_params(params: &ParamSet, layout: &FlatLayout, flat: &Tensor) -> Result<()> {
    // Packed at the layout's offsets (`pack_params`), on the values' device: one pass writes
    // them all. (Offloaded values are cast on the host first, parameter by parameter: half
    // the bytes to copy.)
    if params
        .iter()
        .next()
        .is_some_and(|p| p.device.same_device(flat.device()))
    {
        let cast = |packed: &Tensor| kernels::cast_into(packed, &flat.to_dtype(DType::F32)?);
        if params.write_flat(&layout.offsets, layout.total, cast)? {
            return Ok(());
        }
    }
    for (i, p) in params.iter().enumerate() {
        let r = layout.range(i);
        p.set(&flat.narrow(0, r.start, r.len())?)?;
    }
    Ok(())
}

/// Elements `r` of the 1-D f32 tensor `t`, on the host, copying only them: candle copies a
/// CUDA tensor's whole storage to the host even for a narrow view of it, so on a GPU the range
/// is first copied into a tensor of its own (a device-to-device copy of just those elements).
pub fn read_f32(t: &Tensor, r: std::ops::Range<usize>) -> Result<Vec<f32>> {
    let view = t.narrow(0, r.start, r.len())?;
    if t.device().is_cpu() {
        return view.to_vec1();
    }
    let part = Tensor::zeros(r.len(), candle_core::DType::F32, t.device())?;
    part.slice_set(&view, 0, 0)?;
    part.to_vec1()
}

/// Writes `values` into the 1-D f32 tensor `t` from element `at`, in place (one host-to-device
/// copy of just those values on a GPU).
pub fn write_f32(t: &Tensor, at: usize, values: &[f32]) -> Result<()> {
    if values.is_empty() {
        return Ok(());
    }
    let part = Tensor::from_slice(values, values.len(), t.device())?;
    t.slice_set(&part, 0, at)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A two-layer model small enough for the optimizer's unit tests.
    pub(crate) fn small_model() -> model::LlamaConfig {
        model::LlamaConfig {
            vocab_size: 64,
            hidden_size: 32,
            intermediate_size: 48,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            max_position_embeddings: 16,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            init_std: 0.02,
            ..Default::default()
        }
    }

    /// Parameters packed at the layout's offsets are written by one cast pass, with the bits the
    /// parameter-by-parameter writes give (f32; bf16 on the CPU is not packed, and written
    /// parameter by parameter alike).
    #[test]
    fn packed_parameters_are_written_in_one_pass_alike() -> Result<()> {
        use model::{Llama, Placement};
        let c = small_model();
        for dtype in [DType::BF16, DType::F32] {
            let build = || Llama::new(&c, Placement::whole(&c), 3, dtype, &Device::Cpu);
            let (apart, packed) = (build()?, build()?);
            let layout = layout_of(apart.params(), 1000, 2); // buckets padded for 2 shards
            pack_params(packed.params(), &layout)?;
            // 16-bit parameters on the CPU keep storages of their own.
            let flat = packed.params().flat_at(&layout.offsets, layout.total);
            assert_eq!(flat.is_some(), dtype == DType::F32);
            let values = (Tensor::randn(0f32, 1.0, layout.total, &Device::Cpu)? * 3.0)?;
            write_params(apart.params(), &layout, &values)?;
            write_params(packed.params(), &layout, &values)?;
            for (a, b) in apart.params().iter().zip(packed.params().iter()) {
                let bits = |t: Tensor| -> Result<Vec<u32>> {
                    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    Ok(v.iter().map(|x| x.to_bits()).collect())
                };
                assert_eq!(
                    bits(a.tensor()?)?,
                    bits(b.tensor()?)?,
                    "{dtype:?} {}",
                    a.name
                );
            }
        }
        Ok(())
    }
}
