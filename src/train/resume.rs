//! What a resume may change from the checkpoint's recipe. Refused unless
//! `checkpoint.accept_changes` lists them: another seed, `data:` section or datasets on disk
//! (sizes and index checksum), sequence length, optimizer, tokenizer file (by content), or model
//! settings that keep every tensor's shape.
//! Another model (any tensor's shape) is always refused. Every other change of the `train`,
//! `optimizer` and `schedule` sections is said in the log, as a warning where it changes the
//! math of the run from here on.

use std::path::Path;

use anyhow::{bail, Context, Result};
use ckpt::{Checkpoint, DatasetEntry, Manifest};
use tracing::{info, warn};

use super::Trainer;
use crate::recipe::ResumeChange;

/// Keys whose change leaves the math of the steps as it was (said at info level).
const BENIGN: [&str; 14] = [
    "train.steps",
    "train.micro_batch",
    "train.recompute",
    "train.recompute_modules",
    "train.eval_interval",
    "train.eval_batches",
    "train.on_nonfinite",
    "train.max_skips",
    "train.spike_factor",
    "train.attention",
    "train.deterministic",
    "optimizer.state_dtype",
    "optimizer.offload",
    "optimizer.offload_threads",
];

/// `section.key` paths of the leaves under `sections` of a recipe as YAML, with their values.
fn leaves(v: &serde_yaml::Value, sections: &[&str]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for s in sections {
        if let Some(serde_yaml::Value::Mapping(m)) = v.get(s) {
            for (k, val) in m {
                let text = serde_yaml::to_string(val).unwrap_or_default();
                out.push((
                    format!("{s}.{}", k.as_str().unwrap_or("?")),
                    text.trim().replace('\n', " "),
                ));
            }
        }
    }
    out
}

/// The checkpoint's `optimizer.name` (AdamW for checkpoints that predate the field).
pub(super) fn stored_optimizer(m: &Manifest) -> String {
    serde_yaml::from_str::<serde_yaml::Value>(&m.recipe)
        .ok()
        .and_then(|r| r.get("optimizer")?.get("name")?.as_str().map(String::from))
        .unwrap_or_else(|| "adamw".into())
}

impl Trainer {
    /// Refuses a resume that changed what `accept_changes` must accept (see the module), or
    /// that has nothing left to train; says every other change.
    pub(super) fn check_resume_changes(
        &self,
        dir: &Path,
        ck: &Checkpoint,
        m: &Manifest,
    ) -> Result<()> {
        let (t, accept) = (&self.recipe.train, &self.recipe.checkpoint.accept_changes);
        let main = self.ctx.is_main();
        if m.step > t.steps as u64 {
            bail!(
                "{}: the checkpoint is at step {}, beyond train.steps = {}: nothing to train \
                 (raise train.steps)",
                dir.display(),
                m.step,
                t.steps
            );
        }
        if m.step == t.steps as u64 && main {
            warn!(
                "{}: the checkpoint is at step {} = train.steps: nothing left to train (raise \
                 train.steps to go on)",
                dir.display(),
                m.step
            );
        }
        if m.seed != t.seed && !accept.contains(&ResumeChange::Seed) {
            bail!(
                "{}: the checkpoint was trained with train.seed {}, the recipe has {}: the data \
                 order would change from here on. Use the same seed, or accept the change with \
                 checkpoint.accept_changes: [seed]",
                dir.display(),
                m.seed,
                t.seed
            );
        }
        let stored: serde_yaml::Value = serde_yaml::from_str(&m.recipe)
            .with_context(|| format!("{}: recipe of the manifest", dir.display()))?;
        if let Some(data) = stored.get("data") {
            let ours = serde_yaml::to_value(&self.recipe.data)?;
            if *data != ours && !accept.contains(&ResumeChange::Data) {
                bail!(
                    "{}: the checkpoint was trained on other data (its data: section is {}; the \
                     recipe's is {}). Restore it, or accept the change with \
                     checkpoint.accept_changes: [data]",
                    dir.display(),
                    serde_json::to_string(data)?,
                    serde_json::to_string(&ours)?
                );
            }
        }
        if stored.get("data") == Some(&serde_yaml::to_value(&self.recipe.data)?) {
            self.check_datasets(dir, m)?;
        }
        self.check_tokenizer(dir, ck)?;
        let stored_seq = stored
            .get("train")
            .and_then(|t| t.get("seq_len"))
            .and_then(|s| s.as_u64());
        if let Some(was) = stored_seq.filter(|&s| s != t.seq_len as u64) {
            if !accept.contains(&ResumeChange::SeqLen) {
                bail!(
                    "{}: the checkpoint was trained with train.seq_len {was}, the recipe has {}: \
                     samples are counted in sequences, so the data position would move (tokens \
                     seen again or skipped). Use {was}, or accept the change with \
                     checkpoint.accept_changes: [seq_len] (a context-length extension)",
                    dir.display(),
                    t.seq_len
                );
            }
            if main {
                info!(
                    "resume: train.seq_len changed from {was} to {} (accepted)",
                    t.seq_len
                );
            }
        }
        let stored_optimizer = stored_optimizer(m);
        let ours = self.recipe.optimizer.name.to_string();
        if stored_optimizer != ours {
            if !accept.contains(&ResumeChange::Optimizer) {
                bail!(
                    "{}: the checkpoint was trained with optimizer.name {stored_optimizer}, the \
                     recipe has {ours}: the hidden matrices' optimizer state would be lost. Use \
                     {stored_optimizer}, or accept the change with \
                     checkpoint.accept_changes: [optimizer] (the new optimizer's state starts at \
                     zero)",
                    dir.display()
                );
            }
            if main {
                info!(
                    "resume: optimizer.name changed from {stored_optimizer} to {ours} (accepted; \
                     its state starts at zero for the matrices that change optimizer)"
                );
            }
        }
        // Every other change of the sections that drive the steps, said.
        if main {
            let ours = serde_yaml::to_value(&self.recipe)?;
            let sections = ["train", "optimizer", "schedule"];
            let was: std::collections::BTreeMap<_, _> =
                leaves(&stored, &sections).into_iter().collect();
            for (key, now) in leaves(&ours, &sections) {
                let handled = ["train.seed", "train.seq_len", "optimizer.name"];
                let Some(before) = was.get(&key).filter(|b| **b != now) else {
                    continue;
                };
                if handled.contains(&key.as_str()) {
                    continue;
                }
                if BENIGN.contains(&key.as_str()) {
                    info!("resume: {key} changed from {before} to {now}");
                } else {
                    warn!(
                        "resume: {key} changed from {before} to {now}: the run goes on with \
                         the new value"
                    );
                }
            }
        }
        Ok(())
    }

    /// The recipe's datasets as they are on disk: sizes and the index's SHA-256 (hashed once).
    pub(super) fn dataset_entries(&self) -> Result<&[DatasetEntry]> {
        if let Some(d) = self.saves.datasets.get() {
            return Ok(d);
        }
        let mut entries = Vec::new();
        for d in &self.recipe.data.datasets {
            let file = |ext: &str| {
                let mut p = d.prefix.clone().into_os_string();
                p.push(ext);
                std::path::PathBuf::from(p)
            };
            let (bin, idx) = (file(".bin"), file(".idx"));
            let size = |p: &Path| {
                std::fs::metadata(p)
                    .map(|m| m.len())
                    .with_context(|| format!("reading {}", p.display()))
            };
            let mut f =
                std::fs::File::open(&idx).with_context(|| format!("reading {}", idx.display()))?;
            let idx_sha256 =
                ckpt::sha256_hex(&mut f).with_context(|| format!("reading {}", idx.display()))?;
            entries.push(DatasetEntry {
                prefix: d.prefix.display().to_string(),
                bin_bytes: size(&bin)?,
                idx_bytes: size(&idx)?,
                idx_sha256,
            });
        }
        Ok(self.saves.datasets.get_or_init(|| entries))
    }

    /// Refuses datasets whose files changed since the checkpoint was written, under the same
    /// `data:` section (other data at the same paths), unless `accept_changes` lists `data`.
    fn check_datasets(&self, dir: &Path, m: &Manifest) -> Result<()> {
        if m.datasets.is_empty() {
            return Ok(()); // an older checkpoint, or an import: nothing recorded
        }
        let ours = self.dataset_entries()?;
        let changed: Vec<String> = m
            .datasets
            .iter()
            .filter_map(|was| {
                let now = ours.iter().find(|o| o.prefix == was.prefix)?;
                (now != was).then(|| {
                    let what = if (now.bin_bytes, now.idx_bytes) != (was.bin_bytes, was.idx_bytes) {
                        format!(
                            "{} + {} bytes then, {} + {} now",
                            was.bin_bytes, was.idx_bytes, now.bin_bytes, now.idx_bytes
                        )
                    } else {
                        "same sizes, other documents".to_string()
                    };
                    format!("{} ({what})", was.prefix)
                })
            })
            .collect();
        if changed.is_empty() {
            return Ok(());
        }
        if !self
            .recipe
            .checkpoint
            .accept_changes
            .contains(&ResumeChange::Data)
        {
            bail!(
                "{}: the datasets changed on disk since the checkpoint was written: {}. The \
                 data position would point into other documents. Restore them, or accept the \
                 change with checkpoint.accept_changes: [data]",
                dir.display(),
                changed.join("; ")
            );
        }
        if self.ctx.is_main() {
            warn!(
                "resume: datasets changed on disk: {} (accepted)",
                changed.join("; ")
            );
        }
        Ok(())
    }

    /// Refuses a tokenizer file whose contents differ from the checkpoint's copy (the token ids
    /// the model learned would mean other text) unless `accept_changes` lists `tokenizer`.
    fn check_tokenizer(&self, dir: &Path, ck: &Checkpoint) -> Result<()> {
        let (ours, theirs) = (&self.recipe.data.tokenizer, ck.tokenizer_path());
        // Read without blocking on a FIFO planted in place of either.
        let read = |p: &Path| crate::files::read_capped(p, data::MAX_TOKENIZER_BYTES);
        let same = match (read(ours), read(&theirs)) {
            (Ok(a), Ok(b)) => a == b,
            // A checkpoint without its copy (an old one) has nothing to compare.
            (_, Err(crate::files::ReadError::Io(e)))
                if e.kind() == std::io::ErrorKind::NotFound =>
            {
                true
            }
            (Err(e), _) => return Err(e).with_context(|| format!("reading {}", ours.display())),
            (_, Err(e)) => return Err(e).with_context(|| format!("reading {}", theirs.display())),
        };
        let accept = &self.recipe.checkpoint.accept_changes;
        if !same && !accept.contains(&ResumeChange::Tokenizer) {
            bail!(
                "{}: the recipe's data.tokenizer {} differs from the checkpoint's copy {}: the \
                 token ids the model learned would stand for other text. Use the checkpoint's \
                 tokenizer, or accept the change with checkpoint.accept_changes: [tokenizer]",
                dir.display(),
                ours.display(),
                theirs.display()
            );
        }
        if !same && self.ctx.is_main() {
            warn!(
                "resume: data.tokenizer {} differs from the checkpoint's (accepted)",
                ours.display()
            );
        }
        Ok(())
    }

    /// Refuses a checkpoint of another model than the recipe's: any tensor of another shape,
    /// always; settings that keep every shape (RoPE, init, router coefficients, ...) unless
    /// `accept_changes` lists `model`. Token ids are metadata, which a recipe leaving them unset
    /// inherits.
    pub(super) fn check_same_model(&mut self, dir: &Path, m: &Manifest) -> Result<()> {
        // Token ids are the exported config's metadata, not the model's math: a recipe that
        // leaves them unset inherits the checkpoint's (e.g. those of an imported model).
        let stored: model::LlamaConfig = serde_json::from_value(m.model.clone())
            .with_context(|| format!("{}: model of the manifest", dir.display()))?;
        let c = &mut self.recipe.model;
        c.bos_token_id = c.bos_token_id.or(stored.bos_token_id);
        c.eos_token_id = c.eos_token_id.clone().or(stored.eos_token_id.clone());
        let (want, have) = (
            serde_json::to_value(&self.recipe.model)?,
            serde_json::to_value(&stored)?,
        );
        let keys: std::collections::BTreeSet<&String> = [&want, &have]
            .into_iter()
            .filter_map(|v| v.as_object())
            .flat_map(|o| o.keys())
            .filter(|k| !k.ends_with("token_id"))
            .collect();
        let null = serde_json::Value::Null;
        let diff: Vec<String> = keys
            .into_iter()
            .filter(|k| want.get(k.as_str()) != have.get(k.as_str()))
            .map(|k| {
                format!(
                    "model.{k}: checkpoint {}, recipe {}",
                    have.get(k.as_str()).unwrap_or(&null),
                    want.get(k.as_str()).unwrap_or(&null)
                )
            })
            .collect();
        if diff.is_empty() {
            return Ok(());
        }
        let same_shapes = self.recipe.model.tensor_shapes() == stored.tensor_shapes();
        let accepted = self
            .recipe
            .checkpoint
            .accept_changes
            .contains(&ResumeChange::Model);
        match (same_shapes, accepted) {
            (true, true) => {
                if self.ctx.is_main() {
                    warn!("resume: {} (accepted)", diff.join("; "));
                }
                Ok(())
            }
            (true, false) => bail!(
                "{}: the checkpoint's model settings differ ({}); every tensor keeps its shape, \
                 so the change can be accepted with checkpoint.accept_changes: [model]",
                dir.display(),
                diff.join("; ")
            ),
            (false, _) => bail!(
                "{}: checkpoint of a different model ({})",
                dir.display(),
                diff.join("; ")
            ),
        }
    }
}
