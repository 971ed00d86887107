//! Saving and restoring a rank's training state through `ckpt`: the optimizer's fp32 master
//! weights and its moments in their state dtype (the parameters are the masters cast to their
//! dtype), step and samples consumed. Pieces carry global coordinates, so a checkpoint loads at
//! any layout, and under either moment dtype.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use ckpt::{Checkpoint, Kind, Manifest, PieceDtype, RankWriter, TensorBlock, Values};
use parallel::dp::intersect;
use parallel::Group;
use tracing::info;

use super::saver::SaveJob;
use super::Trainer;

/// The block of its tensor that parameter `p` holds on this rank, in checkpoint terms.
pub fn tensor_block(p: &model::Parameter) -> TensorBlock<'_> {
    TensorBlock {
        name: &p.name,
        global_shape: &p.global_shape,
        offset: &p.block.offset,
        shape: &p.block.shape,
    }
}

/// Where a piece of a rank's checkpoint share lives: in Muon's state or AdamW's, its kind, and
/// its elements there.
pub(super) struct Source {
    muon: bool,
    kind: Kind,
    own: Range<usize>,
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
        self.settle()?; // nothing is saved of an update that left the state non-finite
        self.wait_for_save()?;
        let start = Instant::now();
        let (root, step) = (self.checkpoint_root(), self.step as u64);
        let world = self.world();
        let save_wait = std::time::Duration::from_secs_f64(self.recipe.checkpoint.timeout_s);
        if self.ctx.is_main() {
            std::fs::create_dir_all(&root)
                .with_context(|| format!("creating {}", root.display()))?;
            let stale = ckpt::tmp_dir(&root, step);
            if stale.exists() {
                std::fs::remove_dir_all(&stale)
                    .with_context(|| format!("removing {}", stale.display()))?;
            }
        }
        // Every rank's previous save is complete (rank 0's pruning included) before any starts.
        self.ctx.comm.barrier_within(&world, save_wait)?;
        let now = self.recipe.checkpoint.async_save;
        let (writer, sources) = self.snapshot(&root, step, now)?;
        let mut job = SaveJob {
            writer: Some(writer),
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
            timeout: save_wait,
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
            self.saves.saving = Some(job.spawn()?);
            return Ok(dir);
        }
        let main = self.ctx.is_main();
        let fill = |i: usize, _: &ckpt::PieceMeta| -> Result<Values, ckpt::SourceError> {
            Ok(self.read_piece(&sources[i])?)
        };
        let written = job.write_share_with(fill).and_then(|()| {
            self.ctx.comm.barrier_within(&world, save_wait)?;
            job.finalize()
        });
        if let Err(e) = &written {
            // Rank 0's own failure (a full disk) frees the temporary directory at once; the
            // failure is published first, so that the ranks still writing into it, which then
            // fail too, are not taken for the cause. After another rank's failure the directory
            // stays (those ranks may still be writing; the next save of this step removes it).
            let peer = e
                .chain()
                .any(|c| parallel::CommError::find(c).is_some_and(|c| c.is_peer_failure()));
            if main && !peer {
                self.ctx.comm.abort(&format!("{e:#}"));
                super::saver::abandon(&self.checkpoint_root(), step);
            }
        }
        written?;
        self.ctx.comm.barrier_within(&world, save_wait)?;
        Ok(dir)
    }

    /// Waits for the checkpoint being written in the background, if any; its failure is this
    /// run's.
    pub fn wait_for_save(&mut self) -> Result<()> {
        match self.saves.saving.take() {
            None => Ok(()),
            // The writer's error names the step it was saving.
            Some(h) => h
                .join()
                .map_err(|_| anyhow::anyhow!("the checkpoint writer panicked"))?,
        }
    }

    /// This rank's share of the checkpoint of `step`, the owned optimizer state's pieces with
    /// where each comes from. `now`: read every piece into host memory here (an asynchronous
    /// save, written while training changes the state: one host copy of the share, built piece
    /// by piece); otherwise the pieces are declared and read from the state while the file is
    /// written ([`Trainer::read_piece`]), one at a time.
    fn snapshot(&self, root: &Path, step: u64, now: bool) -> Result<(RankWriter, Vec<Source>)> {
        let mut writer = RankWriter::new(root, step, self.ctx.rank)?;
        let mut sources = Vec::new();
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
        if !(sharded || first_replica || first_expert_replica) {
            return Ok((writer, sources));
        }
        let expert = self.model.inventory().expert_flags();
        let writes = |i: usize| {
            sharded
                || if expert[i] {
                    first_expert_replica
                } else {
                    first_replica
                }
        };
        let parts = [
            Some((false, self.state.optimizer.adamw().owned())),
            self.state.optimizer.muon().map(|m| (true, m.owned())),
        ];
        for (muon, owned) in parts.into_iter().flatten() {
            for (kind, i, local, own) in self.pieces(owned, &writes, muon) {
                let block = tensor_block(self.model.params().get(i));
                let source = Source { muon, kind, own };
                if now {
                    writer.add(kind, block, local, self.read_piece(&source)?);
                } else {
                    let dtype = match kind {
                        Kind::ExpAvg | Kind::ExpAvgSq => {
                            self.state.optimizer.adamw().moment_dtype()
                        }
                        _ => ckpt::PieceDtype::F32,
                    };
                    let index = writer.declare(kind, block, local, dtype);
                    debug_assert_eq!(index, sources.len());
                    sources.push(source);
                }
            }
        }
        Ok((writer, sources))
    }

    /// The values of a piece of this rank's share, read from its optimizer state.
    pub(super) fn read_piece(&self, s: &Source) -> Result<Values> {
        Ok(if s.muon {
            let muon = self
                .state
                .optimizer
                .muon()
                .context("a Muon piece without Muon")?;
            Values::F32(muon.read(s.kind, s.own.clone())?)
        } else {
            self.state.optimizer.adamw().read(s.kind, s.own.clone())?
        })
    }

    /// The pieces of one optimizer part (AdamW's kinds, or Muon's for its hidden matrices: `muon`)
    /// over its flat ranges `owned`, for the parameters this rank writes (`writes`, and owned
    /// copies): each kind, its parameter's index, the elements of its block it holds and where
    /// they are in the part's state.
    fn pieces(
        &self,
        owned: &[Range<usize>],
        writes: &dyn Fn(usize) -> bool,
        muon: bool,
    ) -> Vec<(Kind, usize, Range<usize>, Range<usize>)> {
        let layout = self.state.grads.layout();
        let hidden = self.model.inventory().hidden_matrices();
        let mut out = Vec::new();
        for (i, p) in self.model.params().iter().enumerate() {
            let with_muon = self.state.optimizer.muon().is_some() && hidden[i];
            if !self.owns_copy(p) || !writes(i) || with_muon != muon {
                continue; // replicas and the tied copy are written by their owner
            }
            let kinds: &[Kind] = if muon { &Kind::MUON } else { &Kind::ADAMW };
            let mut base = 0;
            for r in owned {
                let cut = intersect(&layout.range(i), r);
                if !cut.is_empty() {
                    let local = cut.start - layout.offsets[i]..cut.end - layout.offsets[i];
                    let own = base + cut.start - r.start..base + cut.end - r.start;
                    for &kind in kinds {
                        out.push((kind, i, local.clone(), own.clone()));
                    }
                }
                base += r.len();
            }
        }
        out
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
        if !dir.join(ckpt::MANIFEST).exists() && dir.join(ckpt::LATEST).is_file() {
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
        // Checkpoints written before the loop state was saved: every step was an update.
        let progress: super::guard::LoopState = if m.trainer.is_null() {
            super::guard::LoopState {
                updates: m.step,
                ..Default::default()
            }
        } else {
            let state: super::guard::LoopState = serde_json::from_value(m.trainer.clone())
                .with_context(|| format!("{}: trainer state of the manifest", dir.display()))?;
            let problems = state.problems(m.step);
            if !problems.is_empty() {
                bail!(
                    "{}: the manifest's trainer state is not one a run writes (was it edited?): \
                     {}",
                    dir.join(ckpt::MANIFEST).display(),
                    problems.join("; ")
                );
            }
            state
        };
        let (stored, ours) = (ck.dtype(Kind::ExpAvg), self.state.optimizer.moment_dtype());
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
        self.load_owned_state(dir, &ck, false, &Kind::ADAMW)?;
        self.state.optimizer.adamw_mut().set_step(progress.updates);
        if self.state.optimizer.muon().is_some() {
            self.load_owned_state(dir, &ck, true, &Kind::MUON)?;
        }
        self.progress = progress;
        self.model.set_expert_bias(&self.progress.expert_bias);
        super::zero::publish(
            &self.state.optimizer,
            &mut self.state.dp,
            &self.model,
            &self.ctx,
        )?;
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

    /// Streams this rank's owned optimizer state of `kinds` (AdamW's, or Muon's: `muon`) from
    /// `ck` (in `dir`) into the optimizer in place, one parameter's block at a time (bf16 moments
    /// widened exactly, then converted to the state's dtype); the padding of the owned ranges is
    /// zeroed. So a resume holds about one tensor on the host and never a second copy of the
    /// state on the device. A tensor's optimizer state the checkpoint lacks whole (the other
    /// optimizer's, where `optimizer.name` changed and the change is accepted, or any at step 0)
    /// starts at zero; any other state missing, or a value that is not finite, is an error.
    fn load_owned_state(
        &mut self,
        dir: &Path,
        ck: &Checkpoint,
        muon: bool,
        kinds: &[Kind],
    ) -> Result<()> {
        let layout = self.state.grads.layout().clone();
        // Missing state is zero where the optimizer changed (accepted) or nothing has been
        // trained yet (an imported model's step 0: every moment is zero).
        let zero_ok = ck.manifest().step == 0
            || super::resume::stored_optimizer(ck.manifest())
                != self.recipe.optimizer.name.to_string();
        let owned: Vec<Range<usize>> = match (muon, self.state.optimizer.muon()) {
            (true, Some(m)) => m.owned().to_vec(),
            (true, None) => bail!("loading Muon's state without Muon"),
            (false, _) => self.state.optimizer.adamw().owned().to_vec(),
        };
        // Each owned range's start in the part's state (its ranges back to back).
        let bases: Vec<usize> = owned
            .iter()
            .scan(0, |at, r| {
                let b = *at;
                *at += r.len();
                Some(b)
            })
            .collect();
        let write =
            |optimizer: &mut crate::optim::Optimizer, kind, own, values: Vec<f32>| match optimizer
                .muon_mut()
                .filter(|_| muon)
            {
                Some(m) => m.write(kind, own, &values),
                None => optimizer.adamw_mut().write(kind, own, &Values::F32(values)),
            };
        // The flat cuts of each owned range that parameters hold (the rest is padding).
        let mut covered: Vec<Vec<Range<usize>>> = vec![Vec::new(); owned.len()];
        for (i, p) in self.model.params().iter().enumerate() {
            // This parameter's owned cuts: elements of its block and where they sit in the state.
            let cuts: Vec<(Range<usize>, Range<usize>)> = (owned.iter().zip(&bases))
                .enumerate()
                .filter_map(|(j, (r, &base))| {
                    let cut = intersect(&layout.range(i), r);
                    if cut.is_empty() {
                        return None;
                    }
                    covered[j].push(cut.clone());
                    let local = cut.start - layout.offsets[i]..cut.end - layout.offsets[i];
                    Some((local, base + cut.start - r.start..base + cut.end - r.start))
                })
                .collect();
            if cuts.is_empty() {
                continue;
            }
            for &kind in kinds {
                let block = if kind != Kind::Master && !ck.has(kind, &p.name) {
                    let moments = kinds.iter().filter(|&&k| k != Kind::Master);
                    if !(moments.clone().all(|&k| !ck.has(k, &p.name)) && zero_ok) {
                        bail!(
                            "{}: the checkpoint has no {} state of {}; it cannot be resumed \
                             exactly (use an earlier checkpoint)",
                            dir.display(),
                            kind.as_str(),
                            p.name
                        );
                    }
                    None
                } else {
                    Some(ck.read_block(kind, tensor_block(p))?)
                };
                for (local, own) in &cuts {
                    let values = match &block {
                        Some(b) => b[local.clone()].to_vec(),
                        None => vec![0.0; own.len()],
                    };
                    if let Some(bad) = values.iter().position(|v| !v.is_finite()) {
                        bail!(
                            "{}: the checkpoint holds a non-finite {} value ({}) at element {} of \
                             this rank's state; it cannot be resumed (use an earlier checkpoint)",
                            dir.display(),
                            kind.as_str(),
                            values[bad],
                            own.start + bad
                        );
                    }
                    write(&mut self.state.optimizer, kind, own.clone(), values)?;
                }
            }
        }
        // The padding between and after the parameters of each owned range is zero.
        for ((r, &base), cuts) in owned.iter().zip(&bases).zip(&mut covered) {
            cuts.sort_by_key(|c| c.start);
            let mut at = r.start;
            let ends = cuts
                .iter()
                .map(|c| (c.start, c.end))
                .chain([(r.end, r.end)]);
            for (start, end) in ends {
                if start > at {
                    let pad = base + at - r.start..base + start - r.start;
                    for &kind in kinds {
                        write(
                            &mut self.state.optimizer,
                            kind,
                            pad.clone(),
                            vec![0.0; pad.len()],
                        )?;
                    }
                }
                at = at.max(end);
            }
        }
        Ok(())
    }
}
