//! Writing a checkpoint once its state is on the host: every rank's shard file, then (rank 0)
//! the manifest, the rename into place, `latest` and pruning — on the training thread, or with
//! `checkpoint.async: true` on a background thread while training goes on.
//!
//! An asynchronous save cannot use the communicator (the training thread owns its order of
//! collectives), so rank 0's writer waits for the other ranks' shares on the file system: a
//! rank's record file is renamed into place after its shard file is synced, so its presence
//! means that rank is done. The same atomic rules hold as for a synchronous save: a save that
//! dies leaves `step-N.tmp` and the previous checkpoint loadable. At most one save is in flight:
//! the next one (and the end of the run) waits for it, and every rank meets at a barrier before
//! starting one, so rank 0's pruning never races another rank's next save.

use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ckpt::{Manifest, RankWriter};
use tracing::info;

/// What one rank still has to do for a checkpoint whose state it has copied to the host.
pub struct SaveJob {
    /// This rank's share, state included (taken when written).
    pub writer: Option<RankWriter>,
    /// The checkpoint root.
    pub root: PathBuf,
    /// The step saved.
    pub step: u64,
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// Rank 0's part: the manifest (files and pieces filled at finalisation).
    pub manifest: Option<Manifest>,
    /// The tokenizer copied into the checkpoint.
    pub tokenizer: PathBuf,
    /// Checkpoints kept.
    pub keep: usize,
    /// How long rank 0 waits for the other ranks' shares (asynchronous saves).
    pub timeout: Duration,
    /// When the save began.
    pub start: Instant,
}

impl SaveJob {
    /// The step directory this job completes.
    pub fn dir(&self) -> PathBuf {
        self.root.join(ckpt::step_dir_name(self.step))
    }

    /// Writes this rank's share (every piece holding its values).
    pub fn write_share(&mut self) -> Result<()> {
        self.write_share_with(|_, m| Err(format!("{}: no values", m.key).into()))
    }

    /// Writes this rank's share, reading each declared piece through `fill` (see
    /// [`RankWriter::write_with`]).
    pub fn write_share_with(
        &mut self,
        fill: impl FnMut(usize, &ckpt::PieceMeta) -> Result<ckpt::Values, ckpt::SourceError>,
    ) -> Result<()> {
        // An injected fault (`crate::faults`) may make this share late, so rank 0 must really
        // wait for the last record.
        if let Some(delay) = crate::faults::faults().share_delay(self.rank) {
            std::thread::sleep(delay);
        }
        if let Some(w) = self.writer.take() {
            w.write_with(fill)?;
        }
        Ok(())
    }

    /// Rank 0, after every rank has written its share: manifest, rename, `latest`, pruning.
    pub fn finalize(self) -> Result<()> {
        let Some(manifest) = self.manifest else {
            return Ok(());
        };
        let step = self.step;
        // An injected fault (`crate::faults`) for crash-consistency tests: hold the save between
        // the shard files and the manifest so a test can kill the process right there.
        if let Some(pause) = crate::faults::faults().save_pause {
            let ms = pause.as_millis();
            info!("checkpoint step {step}: shards written, pausing {ms} ms before the manifest");
            std::thread::sleep(pause);
        }
        let dir = ckpt::finalize(
            &self.root,
            manifest,
            self.world_size,
            &self.tokenizer,
            self.keep,
        )?;
        info!(
            "saved checkpoint {} in {:.2}s",
            dir.display(),
            self.start.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Rank 0 of an asynchronous save: waits until every rank's record is in the temporary
    /// directory.
    fn wait_for_shares(&self) -> Result<()> {
        let tmp = ckpt::tmp_dir(&self.root, self.step);
        let deadline = Instant::now() + self.timeout;
        loop {
            let missing: Vec<usize> = (0..self.world_size)
                .filter(|r| !tmp.join(format!("rank-{r:05}.json")).exists())
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "checkpoint of step {}: ranks {missing:?} did not write their shares within \
                     {:.0}s",
                    self.step,
                    self.timeout.as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs the rest of the save on a background thread.
    pub fn spawn(mut self) -> Result<JoinHandle<Result<()>>> {
        let step = self.step;
        std::thread::Builder::new()
            .name(format!("checkpoint-{step}"))
            .spawn(move || {
                let (root, main) = (self.root.clone(), self.manifest.is_some());
                let written = (|| {
                    self.write_share()?;
                    if self.manifest.is_some() {
                        self.wait_for_shares()?;
                    }
                    self.finalize()
                })();
                if written.is_err() && main {
                    abandon(&root, step);
                }
                written.with_context(|| {
                    format!("writing the checkpoint of step {step} in the background")
                })
            })
            .with_context(|| format!("starting the writer of checkpoint {step}"))
    }
}

/// Rank 0, after a save failed: removes its temporary directory (best effort), so that a full
/// disk gets its space back at once rather than at the next save that succeeds.
pub fn abandon(root: &std::path::Path, step: u64) {
    let tmp = ckpt::tmp_dir(root, step);
    if let Err(e) = std::fs::remove_dir_all(&tmp) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("removing {} after the failed save: {e}", tmp.display());
        }
    }
}
