//! `PlanError`: why a recipe's layout cannot be planned (its parameters do not split, its
//! pipeline has no schedule, its ranks make no mesh).

use parallel::mesh::MeshError;
use parallel::pipeline::ScheduleError;
use parallel::tp::ShardError;

/// Why a layout cannot be planned.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A parameter does not split over the tensor-parallel ranks.
    #[error("parallel.tp: {0}")]
    TensorSplit(#[from] ShardError),
    /// The step's pipeline schedule cannot be built.
    #[error("pipeline schedule: {0}")]
    Schedule(#[source] ScheduleError),
    /// A schedule the memory budget is measured on cannot be built (1F1B, or zbv while fitting
    /// its caps).
    #[error("{0}")]
    Budget(#[source] ScheduleError),
    /// zbv finds no order within 1F1B's activation memory.
    #[error(
        "zbv found no order for pp = {pp} and m = {m} (parallel.pipeline_layout {layers:?}, \
         per-stage caps {caps:?} fitted on {m_sim} micro-batches) within 1F1B's activation \
         memory; use zb-h1 or 1f1b"
    )]
    ZbvStalled {
        pp: usize,
        m: usize,
        layers: Vec<usize>,
        caps: Vec<usize>,
        m_sim: usize,
    },
    /// The layout has no pipeline stage.
    #[error("a layout has at least one pipeline stage")]
    NoStage,
    /// The ranks make no mesh.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// A table of measured rates that cannot be read or holds impossible values.
    #[error("rates table {path}: {message}")]
    Rates {
        path: std::path::PathBuf,
        message: String,
    },
}
