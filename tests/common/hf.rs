//! Helpers of the Hugging Face tests (`tests/hf.rs`, `tests/hf_config.rs`): a short tiny run
//! with a checkpoint, a checkpoint's master weights, and edits of an export's files.

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, Kind};
use pretrain::recipe::load;
use pretrain::train::train;

/// The overrides of a 3-step tiny run into `dir` with a checkpoint at step 3, plus `extra`
/// (starting with a comma).
pub fn overrides(dir: &Path, extra: &str) -> Vec<String> {
    vec![format!(
        "train.steps=3,schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,train.micro_batch=4,checkpoint.interval=3,run.dir={}{extra}",
        dir.display()
    )]
}

/// Trains the tiny model for 3 steps and returns its final checkpoint.
pub fn trained(dir: &Path) -> PathBuf {
    train(
        load(Path::new("recipes/tiny.yaml"), &overrides(dir, "")).unwrap(),
        true,
    )
    .unwrap();
    dir.join("checkpoints/step-00000003")
}

/// The master weights of the checkpoint `dir`, by name.
pub fn masters(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let ck = Checkpoint::open(dir).unwrap();
    ck.tensors()
        .into_iter()
        .map(|(n, shape)| {
            let v = ck.read_tensor(&n, Kind::Master, &shape).unwrap();
            (n, v)
        })
        .collect()
}

/// The JSON file `path`.
pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Writes `v` to `path`.
pub fn write_json(path: &Path, v: &serde_json::Value) {
    std::fs::write(path, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

/// Copies the export `from` to `to` with `config.json` edited by `edit`.
pub fn variant(
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

/// Rewrites the safetensors file `path` with `edit` applied to its tensors (name → (dtype, shape, bytes)).
pub fn edit_safetensors(
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
