//! Property-based tests of the inputs a user hands the binary: recipes with any value of any
//! key replaced by hostile YAML (huge, negative, non-finite, wrong types, deep structures) or with
//! bytes mangled, and Hugging Face safetensors files with a mangled header. Each must give an
//! error or a usable result — never a panic — and finish at once.

use std::path::Path;
use std::time::{Duration, Instant};

use pretrain::hf::HfWeights;
use pretrain::recipe::load_str;
use proptest::prelude::*;

const TINY: &str = include_str!("../recipes/tiny.yaml");

fn hostile_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("18446744073709551615".to_string()),
        Just("18446744073709551616".to_string()),
        Just("9223372036854775807".to_string()),
        Just("-1".to_string()),
        Just("0".to_string()),
        Just(".inf".to_string()),
        Just(".nan".to_string()),
        Just("1e308".to_string()),
        Just("~".to_string()),
        Just("[]".to_string()),
        Just("{a: 1}".to_string()),
        Just("\"\"".to_string()),
        Just("/dev/zero".to_string()),
        (1u64..1 << 40).prop_map(|v| v.to_string()),
        "[a-z_]{1,8}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn hostile_recipe_values_are_errors_not_panics(
        edits in prop::collection::vec((any::<prop::sample::Index>(), hostile_value()), 1..4),
        mangle in prop::option::of((any::<prop::sample::Index>(), any::<u8>())),
    ) {
        let mut lines: Vec<String> = TINY.lines().map(str::to_string).collect();
        for (at, value) in edits {
            let keyed: Vec<usize> = (0..lines.len())
                .filter(|&i| lines[i].contains(": ") && !lines[i].trim_start().starts_with('#'))
                .collect();
            let i = keyed[at.index(keyed.len())];
            let key = lines[i].split(": ").next().unwrap_or_default().to_string();
            lines[i] = format!("{key}: {value}");
        }
        let mut text = lines.join("\n").into_bytes();
        if let Some((at, byte)) = mangle {
            let i = at.index(text.len());
            text[i] = byte;
        }
        let text = String::from_utf8_lossy(&text);
        let start = Instant::now();
        if let Ok(r) = load_str(&text, Path::new("fuzzed.yaml"), &[]) {
            // Whatever passes validation can be described without overflow.
            let _ = r.model.num_params();
            let _ = r.grad_accum_steps();
            let _ = r.train.global_batch * r.train.seq_len;
        }
        prop_assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn hostile_safetensors_headers_are_errors_not_panics(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        declared in prop::option::of(any::<u64>()),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 3], &data)
            .unwrap();
        let mut bytes = safetensors::serialize([("w", view)], None).unwrap();
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, byte) in edits {
            let i = at.index(header);
            bytes[i] = byte;
        }
        if let Some(n) = declared {
            bytes[..8].copy_from_slice(&n.to_le_bytes());
        }
        std::fs::write(tmp.path().join("model.safetensors"), &bytes).unwrap();
        let start = Instant::now();
        if let Ok(w) = HfWeights::open(tmp.path()) {
            let names: Vec<String> = w.names().cloned().collect();
            for n in names {
                let _ = w.get(&n, &[2, 3]);
            }
        }
        prop_assert!(start.elapsed() < Duration::from_secs(2));
    }
}
