//! Saving and restoring a rank's training state through `ckpt`: the optimizer's fp32 master
//! weights and its moments in their state dtype (the parameters are the masters cast to their
//! dtype), step and samples consumed. Pieces carry global coordinates, so a checkpoint loads at
//! any layout, and under either moment dtype.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use ckpt::{Checkpoint, Kind, Manifest, PieceDtype, RankWriter, TensorBlock, Values};
use parallel::dp::intersect;
use parallel::Group;
use tracing::info;

use super::saver::SaveJob;
use super::Trainer;
use crate::optim::{AdamWState, MuonState};

/// The block of its tensor that parameter `p` holds on this rank, in checkpoint terms.
pub fn tensor_block(p: &model::Parameter) -> TensorBlock<'_> {
    TensorBlock {
        name: &p.name,
        global_shape: &p.global_shape,
        offset: &p.block.offset,
        shape: &p.block.shape,
    }
}

impl Trainer {
    /// Directory holding this run's step directories.
    pub fn checkpoint_root(&self) -> PathBuf {
        self.recipe.checkpoint_root()
    }

    fn world(&self) -> Group {
        Group::new((0..self.ctx.mesh.world_size()).collect())
    }

    /// Writes a checkpoint of the current step (all ranks take part); returns its directory.
    /// With `checkpoint.async`, the state is copied to host memory here and written by a
    /// background thread (`saver.rs`); the directory appears when that finishes.
    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        self.wait_for_save()?;
        let start = Instant::now();
        let (root, step) = (self.checkpoint_root(), self.step as u64);
        let world = self.world();
        if self.ctx.is_main() {
            std::fs::create_dir_all(&root)
                .with_context(|| format!("creating {}", root.display()))?;
            let stale = root.join(format!("{}.tmp", ckpt::step_dir_name(step)));
            if stale.exists() {
                std::fs::remove_dir_all(&stale)
                    .with_context(|| format!("removing {}", stale.display()))?;
            }
        }
        // Every rank's previous save is complete (rank 0's pruning included) before any starts.
        self.ctx.comm.barrier(&world)?;
        let mut job = SaveJob {
            writer: Some(self.snapshot(&root, step)?),
            root,
            step,
            rank: self.ctx.rank,
            world_size: world.size(),
            manifest: self
                .ctx
                .is_main()
                .then(|| self.manifest(step))
                .transpose()?,
            tokenizer: self.recipe.data.tokenizer.clone(),
            keep: self.recipe.checkpoint.keep,
            timeout: std::time::Duration::from_secs_f64(self.recipe.parallel.timeout_s),
            start,
        };
        let dir = job.dir();
        if self.recipe.checkpoint.async_save {
            if self.ctx.is_main() {
                info!(
                    "checkpoint step {step}: state copied in {:.2}s, writing in the background",
                    start.elapsed().as_secs_f64()
                );
            }
            self.saving = Some(job.spawn()?);
            return Ok(dir);
        }
        let main = self.ctx.is_main();
        let written = job.write_share().and_then(|()| {
            self.ctx.comm.barrier(&world)?;
            job.finalize()
        });
        if written.is_err() && main {
            super::saver::abandon(&self.checkpoint_root(), step);
        }
        written?;
        self.ctx.comm.barrier(&world)?;
        Ok(dir)
    }

    /// Waits for the checkpoint being written in the background, if any; its failure is this
    /// run's.
    pub fn wait_for_save(&mut self) -> Result<()> {
        match self.saving.take() {
            None => Ok(()),
            // The writer's error names the step it was saving.
            Some(h) => h
                .join()
                .map_err(|_| anyhow::anyhow!("the checkpoint writer panicked"))?,
        }
    }

    /// This rank's share of the checkpoint of `step`: host copies of the owned optimizer state.
    fn snapshot(&self, root: &Path, step: u64) -> Result<RankWriter> {
        let mut writer = RankWriter::new(root, step, self.ctx.rank)?;
        // Data- and context-parallel replicas hold identical state: without ZeRO only the first
        // rank of the gradient group writes it. With sharding the first shard group writes
        // (replica groups hold the same shards).
        // Routed experts (which differ between expert-parallel ranks) are written by the first
        // rank of their expert gradient group.
        let first = |g: &parallel::Group| g.ranks().first() == Some(&self.ctx.rank);
        let first_shard_group = first(&self.ctx.groups.replicate);
        let sharded = self.recipe.parallel.zero.shards_optimizer() && first_shard_group;
        let (first_replica, first_expert_replica) = (
            first(&self.ctx.groups.grad),
            first(&self.ctx.groups.expert_grad),
        );
        if sharded || first_replica || first_expert_replica {
            let expert = self.model.inventory().expert_flags();
            let writes = |i: usize| {
                sharded
                    || if expert[i] {
                        first_expert_replica
                    } else {
                        first_replica
                    }
            };
            let adamw = self.optimizer.adamw();
            let state = adamw.state()?; // host copies of [owned] each
            self.write_part(
                &mut writer,
                adamw.owned(),
                &writes,
                &|kind, own| match kind {
                    Kind::ExpAvg => state.exp_avg.slice(own),
                    Kind::ExpAvgSq => state.exp_avg_sq.slice(own),
                    _ => Values::F32(state.master[own].to_vec()),
                },
            );
            if let Some(muon) = self.optimizer.muon() {
                let state = muon.state()?;
                self.write_part(&mut writer, muon.owned(), &writes, &|kind, own| {
                    Values::F32(match kind {
                        Kind::Momentum => state.momentum[own].to_vec(),
                        _ => state.master[own].to_vec(),
                    })
                });
            }
        }
        Ok(writer)
    }

    /// Adds the pieces of one optimizer part over its flat ranges `owned` (AdamW's kinds, or
    /// Muon's) to `writer`, for the parameters this rank writes (`writes`, and owned copies):
    /// `values(kind, range)` gives a kind's values at a range of the part's state.
    fn write_part(
        &self,
        writer: &mut RankWriter,
        owned: &[std::ops::Range<usize>],
        writes: &dyn Fn(usize) -> bool,
        values: &dyn Fn(Kind, std::ops::Range<usize>) -> Values,
    ) {
        let layout = self.grads.layout();
        let hidden = self.model.inventory().hidden_matrices();
        for (i, p) in self.model.params().iter().enumerate() {
            if !self.owns_copy(p) || !writes(i) {
                continue; // replicas and the tied copy are written by their owner
            }
            let kinds: &[Kind] = if self.optimizer.muon().is_some() && hidden[i] {
                &Kind::MUON
            } else {
                &Kind::ADAMW
            };
            let mut base = 0;
            for r in owned {
                let cut = intersect(&layout.range(i), r);
                if !cut.is_empty() {
                    let local = cut.start - layout.offsets[i]..cut.end - layout.offsets[i];
                    let own = base + cut.start - r.start..base + cut.end - r.start;
                    for &kind in kinds {
                        writer.add(
                            kind,
                            tensor_block(p),
                            local.clone(),
                            values(kind, own.clone()),
                        );
                    }
                }
                base += r.len();
            }
        }
    }

    /// Rank 0's manifest of the checkpoint of `step` (files and pieces are filled when it is
    /// finalised).
    fn manifest(&self, step: u64) -> Result<Manifest> {
        Ok(Manifest {
            format: String::new(),
            step,
            consumed_samples: self.consumed,
            seed: self.recipe.train.seed,
            model: serde_json::to_value(&self.recipe.model)?,
            recipe: serde_yaml::to_string(&self.recipe)?,
            layout: serde_json::to_value(&self.recipe.parallel)?,
            trainer: serde_json::to_value(&self.progress)?,
            files: vec![],
            pieces: vec![],
            tokenizer: None,
            datasets: self.dataset_entries()?.to_vec(),
        })
    }

    /// Restores the state saved in step directory `dir`, whatever layout wrote it.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        if !dir.join(ckpt::MANIFEST).exists() && dir.join("latest").is_file() {
            bail!(
                "{} holds checkpoints (it has a `latest` file) but is not one: name a step \
                 directory in it, or use checkpoint.resume=auto with checkpoint.dir set to it",
                dir.display()
            );
        }
        let ck = Checkpoint::open(dir)?;
        let m = ck.manifest();
        self.check_same_model(dir, m)?;
        self.check_resume_changes(dir, &ck, m)?;
        let t = &self.recipe.train;
        let needed =
            m.consumed_samples + (t.steps as u64).saturating_sub(m.step) * t.global_batch as u64;
        if needed > self.data.train.num_samples() {
            bail!(
                "{}: the checkpoint has consumed {} samples at step {}; the remaining {} steps of {} need {needed}, \
                 more than train.steps × train.global_batch = {} provides (raise train.steps)",
                dir.display(),
                m.consumed_samples,
                m.step,
                (t.steps as u64).saturating_sub(m.step),
                t.global_batch,
                self.data.train.num_samples()
            );
        }
        let owned = self.optimizer.adamw().owned().to_vec();
        let state = self.read_owned_state(dir, &ck, &owned, &Kind::ADAMW)?;
        // Checkpoints written before the loop state was saved: every step was an update.
        let progress: super::guard::LoopState = if m.trainer.is_null() {
            super::guard::LoopState {
                updates: m.step,
                ..Default::default()
            }
        } else {
            serde_json::from_value(m.trainer.clone())
                .with_context(|| format!("{}: trainer state of the manifest", dir.display()))?
        };
        let n = state.len() / 3;
        let (stored, ours) = (ck.dtype(Kind::ExpAvg), self.optimizer.moment_dtype());
        if stored != ours && self.ctx.is_main() {
            info!(
                "the checkpoint's AdamW moments are {} and optimizer.state_dtype is {}: \
                 converted ({})",
                stored.as_str(),
                ours.as_str(),
                if ours == PieceDtype::Bf16 {
                    "rounded to nearest"
                } else {
                    "exactly"
                }
            );
        }
        let values = |k: usize| Values::F32(state[k * n..(k + 1) * n].to_vec());
        self.optimizer.adamw_mut().load_state(&AdamWState {
            step: progress.updates,
            master: state[..n].to_vec(),
            exp_avg: values(1),
            exp_avg_sq: values(2),
        })?;
        if let Some(owned) = self.optimizer.muon().map(|m| m.owned().to_vec()) {
            let state = self.read_owned_state(dir, &ck, &owned, &Kind::MUON)?;
            let (master, momentum) = state.split_at(state.len() / 2);
            if let Some(muon) = self.optimizer.muon_mut() {
                muon.load_state(&MuonState {
                    master: master.to_vec(),
                    momentum: momentum.to_vec(),
                })?;
            }
        }
        self.progress = progress;
        self.model.set_expert_bias(&self.progress.expert_bias);
        super::zero::publish(&self.optimizer, &mut self.dp, &self.model, &self.ctx)?;
        self.step = m.step as usize;
        self.consumed = m.consumed_samples;
        if self.ctx.is_main() {
            info!(
                "resumed from {} (step {}, {} samples consumed)",
                dir.display(),
                m.step,
                m.consumed_samples
            );
        }
        Ok(())
    }

    /// This rank's flat ranges `owned` of the values of `kinds` from `ck` (in `dir`), `[kind 0 |
    /// kind 1 | …]` as f32 (bf16 moments widened exactly), all finite. A tensor's optimizer
    /// state the checkpoint lacks whole (the other optimizer's, where `optimizer.name` changed
    /// and the change is accepted, or any at step 0) starts at zero; any other state missing is
    /// an error.
    fn read_owned_state(
        &self,
        dir: &Path,
        ck: &Checkpoint,
        owned: &[std::ops::Range<usize>],
        kinds: &[Kind],
    ) -> Result<Vec<f32>> {
        let layout = self.grads.layout().clone();
        // Missing state is zero where the optimizer changed (accepted) or nothing has been
        // trained yet (an imported model's step 0: every moment is zero).
        let zero_ok = ck.manifest().step == 0
            || super::resume::stored_optimizer(ck.manifest())
                != self.recipe.optimizer.name.to_string();
        let n: usize = owned.iter().map(|r| r.len()).sum();
        let mut state = vec![0f32; kinds.len() * n];
        let params = self.model.params();
        for (k, &kind) in kinds.iter().enumerate() {
            let mut cache: HashMap<usize, Vec<f32>> = HashMap::new();
            let mut base = 0;
            for r in owned {
                for (i, p) in params.iter().enumerate() {
                    let cut = intersect(&layout.range(i), r);
                    if cut.is_empty() {
                        continue;
                    }
                    if kind != Kind::Master && !ck.has(kind, &p.name) {
                        let moments = kinds.iter().filter(|&&k| k != Kind::Master);
                        let none = moments.clone().all(|&k| !ck.has(k, &p.name));
                        if none && zero_ok {
                            continue;
                        }
                        bail!(
                            "{}: the checkpoint has no {} state of {}; it cannot be resumed \
                             exactly (use an earlier checkpoint)",
                            dir.display(),
                            kind.as_str(),
                            p.name
                        );
                    }
                    if let std::collections::hash_map::Entry::Vacant(e) = cache.entry(i) {
                        e.insert(ck.read_block(kind, tensor_block(p))?);
                    }
                    let block = &cache[&i];
                    let (a, b) = (cut.start - layout.offsets[i], cut.end - layout.offsets[i]);
                    let dst = k * n + base + cut.start - r.start;
                    state[dst..dst + (b - a)].copy_from_slice(&block[a..b]);
                }
                base += r.len();
            }
        }
        if let Some(bad) = state.iter().position(|v| !v.is_finite()) {
            let (k, at) = (bad / n.max(1), bad % n.max(1));
            bail!(
                "{}: the checkpoint holds a non-finite {} value ({}) at element {at} of this rank's \
                 state; it cannot be resumed (use an earlier checkpoint)",
                dir.display(),
                kinds[k].as_str(),
                state[bad]
            );
        }
        Ok(state)
    }
}
