//! Running whole jobs and their outputs: one rank to the end ([`run_rank`]), all ranks of a job as threads of this process ([`train`]), and the
//! assembly of every rank's parameter slices into whole tensors ([`collect`], [`assemble`]).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use candle_core::Device;
use parallel::comm::flight::{FlightRecorder, Recorded};
use parallel::comm::local::{run_local, RankFailed};
use parallel::tp::Block;
use parallel::Comm;

use super::lock::RunLock;
use super::metrics::StepRecord;
use super::{RankCtx, Trainer};
pub use crate::device::device_for;
use crate::job::flight;
use crate::recipe::Recipe;

/// Most ranks a job runs as threads of one process.
pub const MAX_THREAD_RANKS: usize = 1024;

/// What a finished run reports.
pub struct RunOutput {
    /// Every step's record (identical on all ranks).
    pub records: Vec<StepRecord>,
    /// The last validation loss, if validation ran.
    pub val_loss: Option<f64>,
    /// Whole parameters by name, assembled from every rank's slices.
    pub weights: std::collections::BTreeMap<String, Vec<f32>>,
}

/// One rank's block of one parameter.
pub struct WeightSlice {
    /// Parameter name.
    pub name: String,
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// The block of the whole tensor held.
    pub block: Block,
    /// Row-major values of the block.
    pub values: Vec<f32>,
}

/// Assembles whole tensors (row-major) from blocks of any ranks; replicas overwrite each other.
pub fn assemble(
    slices: impl IntoIterator<Item = WeightSlice>,
) -> std::collections::BTreeMap<String, Vec<f32>> {
    let mut out = std::collections::BTreeMap::new();
    for s in slices {
        let full: &mut Vec<f32> = out
            .entry(s.name.clone())
            .or_insert_with(|| vec![0.0; s.global_shape.iter().product()]);
        let b = &s.block;
        let (r0, rows, c0, cols, cols_full) = match (
            s.global_shape.as_slice(),
            b.offset.as_slice(),
            b.shape.as_slice(),
        ) {
            ([_, full], [r0, c0], [r, c]) => (*r0, *r, *c0, *c, *full),
            ([full], [c0], [c]) => (0, 1, *c0, *c, *full),
            _ => continue,
        };
        for r in 0..rows {
            let dst = (r0 + r) * cols_full + c0;
            full[dst..dst + cols].copy_from_slice(&s.values[r * cols..(r + 1) * cols]);
        }
    }
    out
}

/// What one rank of a finished run returns: its step records, last validation loss and its
/// parameter slices.
pub type RankOutput = (Vec<StepRecord>, Option<f64>, Vec<WeightSlice>);

/// Runs rank `rank` of a training job to the end on `device`, communicating through `comm`,
/// recorded by its flight recorder (`super::flight`), for its files (metrics, plots,
/// checkpoints): its weights are not copied off the device (the output's are empty). On failure
/// the communicator is aborted first, so the peers stop promptly.
pub fn run_rank(
    recipe: &Recipe,
    rank: usize,
    comm: Arc<dyn Comm>,
    device: Device,
    write_outputs: bool,
) -> Result<RankOutput> {
    let started = lock_dirs(recipe, rank, write_outputs).and_then(|locks| {
        let recorder = flight::recorder(recipe, rank, write_outputs, false)?;
        Ok((locks, recorder))
    });
    let (locks, recorder) = match started {
        Ok(s) => s,
        Err(e) => {
            comm.abort(&format!("{e:#}"));
            return Err(e);
        }
    };
    let result = run_recorded(recipe, rank, comm, device, write_outputs, false, recorder);
    drop(locks);
    result
}

/// One live run per directory: rank 0 of a run that writes files locks `run.dir` and the
/// checkpoint directory (`super::lock`) before anything of the run is written there, its
/// flight records included, and holds the locks until its run ends. (The other ranks' flight
/// records are locked files of their own: a second run never writes over a live run's.)
fn lock_dirs(recipe: &Recipe, rank: usize, write_outputs: bool) -> Result<Vec<RunLock>> {
    if rank == 0 && (write_outputs || recipe.checkpoint.interval > 0) {
        super::lock::lock_run(&recipe.run.dir, &recipe.checkpoint_root())
    } else {
        Ok(Vec::new())
    }
}

/// [`run_rank`] with the flight recorder `recorder` (the directories already locked), returning
/// the rank's parameter slices when `weights`.
fn run_recorded(
    recipe: &Recipe,
    rank: usize,
    comm: Arc<dyn Comm>,
    device: Device,
    write_outputs: bool,
    weights: bool,
    recorder: Arc<FlightRecorder>,
) -> Result<RankOutput> {
    let comm: Arc<dyn Comm> = Arc::new(Recorded::new(comm, recorder.clone()));
    let ctx = RankCtx::open(&recipe.parallel, rank, comm.clone(), device)
        .and_then(|ctx| Trainer::new(recipe.clone(), ctx, write_outputs));
    let mut trainer = match ctx {
        Ok(mut t) => {
            t.set_flight(recorder);
            t
        }
        Err(e) => {
            comm.abort(&format!("{e:#}"));
            return Err(e);
        }
    };
    match trainer.run() {
        Ok((records, val)) if weights => Ok((records, val, trainer.weight_slices()?)),
        Ok((records, val)) => Ok((records, val, Vec::new())),
        // Every rank stopped at the same step after saving: nothing to abort.
        Err(e) if crate::job::signals::interrupted(&e).is_some() => Err(e),
        Err(e) => {
            // Stop the peers before this rank's trainer (and its gradient-sync thread, which may
            // wait on them) is dropped.
            comm.abort(&format!("{e:#}"));
            Err(e)
        }
    }
}

/// Runs a whole training job in this process: one rank in this thread, or `dp × tp × pp` ranks
/// as threads sharing the local communicator (and one device handle). Returns rank 0's records
/// and the assembled final weights.
pub fn train(recipe: Recipe, write_outputs: bool) -> Result<RunOutput> {
    train_job(recipe, write_outputs, true)
}

/// [`train`] for the run's files only (metrics, plots, checkpoints): the final weights are not
/// copied off the devices and assembled (the output's are empty), which for a large model takes
/// seconds, host memory of the whole model in f32 and a device copy of the parameters.
pub fn train_to_files(recipe: Recipe) -> Result<RunOutput> {
    train_job(recipe, true, false)
}

/// [`train`], assembling the final weights when `weights`.
fn train_job(recipe: Recipe, write_outputs: bool, weights: bool) -> Result<RunOutput> {
    let world = recipe.parallel.world_size();
    if world > MAX_THREAD_RANKS {
        bail!(
            "the layout has {world} ranks; at most {MAX_THREAD_RANKS} run as threads of one \
             process (start processes with --nproc-per-node, torchrun or Slurm)"
        );
    }
    let timeout = Duration::from_secs_f64(recipe.parallel.timeout_s);
    let device = device_for(recipe.train.device, 0)?;
    // Thread ranks share this process and its device.
    super::admit::admit(&recipe, world, &device)?;
    let _locks = lock_dirs(&recipe, 0, write_outputs)?;
    let recorders = (0..world)
        .map(|r| flight::recorder(&recipe, r, write_outputs, true))
        .collect::<Result<Vec<_>>>()?;
    let seen = recorders.clone();
    let _watch = flight::watch(move || flight::from_recorders(&seen, world))?;
    let results = run_local(world, timeout, |rank, comm: Arc<dyn Comm>| {
        let recorder = recorders[rank].clone();
        run_recorded(
            &recipe,
            rank,
            comm,
            device.clone(),
            write_outputs,
            weights,
            recorder,
        )
    })
    .map_err(|f| {
        if flight::timed_out(&f.error) {
            flight::report(&flight::from_recorders(&recorders, world));
        }
        root_cause(f)
    })?;
    Ok(collect(results))
}

/// A failed thread-rank job as an error: the failed rank's own error (its causes kept) in the
/// context "rank R failed".
pub fn root_cause(f: RankFailed<anyhow::Error>) -> anyhow::Error {
    f.error.context(format!("rank {} failed", f.rank))
}

/// Rank 0's records and validation loss, and the weights assembled from every output's slices.
pub fn collect(results: Vec<RankOutput>) -> RunOutput {
    let mut records = None;
    let mut val_loss = None;
    let mut all = Vec::new();
    for (r, v, w) in results {
        if records.is_none() {
            records = Some(r);
            val_loss = v;
        }
        all.extend(w);
    }
    RunOutput {
        records: records.unwrap_or_default(),
        val_loss,
        weights: assemble(all),
    }
}
