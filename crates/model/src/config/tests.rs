//! Tests of the model configuration: RoPE frequencies against transformers and the scaled
//! rotary tables.

use super::*;

fn config(rope_theta: f64, hidden: usize, heads: usize, scaling: RopeScaling) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 64,
        hidden_size: hidden,
        intermediate_size: 32,
        num_hidden_layers: 1,
        num_attention_heads: heads,
        num_key_value_heads: heads,
        head_dim: None,
        rope_theta,
        rope_scaling: Some(scaling),
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        max_position_embeddings: 64,
        init_std: 0.02,
        bos_token_id: None,
        eos_token_id: None,
        ..Default::default()
    }
}

/// Llama 3.1 8B's RoPE (θ = 500000, head dim 128, factor 8, 1, 4, 8192): inverse frequencies
/// as transformers 5.23's `_compute_llama3_parameters` computes them (in f32), at indices in
/// the kept, interpolated and divided ranges.
#[test]
fn llama3_frequencies_equal_transformers() {
    let c = config(
        500000.0,
        4096,
        32,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        },
    );
    let published = [
        (0, 1.0),
        (20, 0.016560440883040428),
        (28, 0.0032114461064338684),
        (29, 0.0021665706299245358),
        (30, 0.0013718936825171113),
        (32, 0.0005248460220173001),
        (34, 0.0001785077911335975),
        (35, 9.556212171446532e-05),
        (40, 3.428102354519069e-05),
        (63, 3.068925877869333e-07),
    ];
    let ours = c.rope_inv_freq();
    assert_eq!(ours.len(), 64);
    for (i, want) in published {
        let rel = (ours[i] - want).abs() / want;
        assert!(rel < 1e-6, "index {i}: {} vs {want}", ours[i]);
    }
    let linear = config(10000.0, 4096, 32, RopeScaling::Linear { factor: 4.0 });
    let published = [
        (0, 0.25),
        (31, 0.002886954927816987),
        (63, 2.8869548259535804e-05),
    ];
    let ours = linear.rope_inv_freq();
    for (i, want) in published {
        assert!((ours[i] - want).abs() / want < 1e-6, "linear {i}");
    }
}

/// The model's rotary tables hold `cos(p·f)`, `sin(p·f)` of Llama 3's scaled frequencies,
/// written here from the published definition (Meta's `apply_scaling`).
#[test]
fn rotary_tables_use_the_scaled_frequencies() {
    let (factor, low, high, old) = (4.0, 1.0, 2.0, 16usize);
    let c = config(
        500000.0,
        64,
        2,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: old,
        },
    );
    let d = 32;
    let m = crate::Llama::new(
        &c,
        crate::Placement::whole(&c),
        0,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let (cos, sin) = m.rope_tables();
    let (cos, sin) = (cos.to_vec2::<f32>().unwrap(), sin.to_vec2::<f32>().unwrap());
    let (mut kept, mut divided, mut smoothed) = (0, 0, 0);
    for i in 0..d / 2 {
        let freq = 1.0 / 500000f64.powf(2.0 * i as f64 / d as f64);
        let wavelen = 2.0 * std::f64::consts::PI / freq;
        let scaled = if wavelen < old as f64 / high {
            kept += 1;
            freq
        } else if wavelen > old as f64 / low {
            divided += 1;
            freq / factor
        } else {
            smoothed += 1;
            let s = (old as f64 / wavelen - low) / (high - low);
            (1.0 - s) * freq / factor + s * freq
        };
        for p in [0usize, 1, 17, 63] {
            let a = p as f64 * scaled;
            assert!((cos[p][i] as f64 - a.cos()).abs() < 1e-6, "cos p={p} i={i}");
            assert!((sin[p][i] as f64 - a.sin()).abs() < 1e-6, "sin p={p} i={i}");
        }
    }
    assert!(
        kept > 0 && divided > 0 && smoothed > 0,
        "{kept} {divided} {smoothed}"
    );
}
