//! Results the layout search remembers: it plans thousands of candidates that share their
//! schedules, zero-bubble fits, simulated bubbles, communicator counts and stages' parameters
//! (a layout is planned for every ZeRO stage, both moment dtypes and every data-parallel size),
//! and computing those again was most of a plan's time. Each kind keeps at most
//! [`MEMO_ENTRIES`] results and starts over when full; errors are never remembered.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use model::Inventory;
use parallel::pipeline::{build_zbv, zbv, Schedule, ScheduleError};

use super::PlanError;

/// Results remembered by [`memo`], at most [`MEMO_ENTRIES`] of a kind.
pub(super) type Memo<T> = OnceLock<Mutex<HashMap<String, T>>>;

/// Entries a [`Memo`] keeps before it starts over.
const MEMO_ENTRIES: usize = 1024;

/// `fit()`, remembered in `cache` under `key` (computed each time without one; errors are not
/// remembered).
pub(super) fn memo<T: Clone, E>(
    cache: &'static Memo<T>,
    key: Option<String>,
    fit: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let Some(key) = key else {
        return fit();
    };
    let cache = cache.get_or_init(Default::default);
    if let Some(v) = cache.lock().ok().and_then(|m| m.get(&key).cloned()) {
        return Ok(v);
    }
    let v = fit()?;
    if let Ok(mut m) = cache.lock() {
        if m.len() >= MEMO_ENTRIES {
            m.clear();
        }
        m.insert(key, v.clone());
    }
    Ok(v)
}

/// [`parallel::register::most_communicators`] of `cfg`, remembered: it walks the rank groups of
/// the whole mesh, and the search plans each parallel layout for many micro-batch sizes,
/// recomputation levels and memory levers.
pub(super) fn most_communicators(
    cfg: &parallel::ParallelConfig,
) -> Result<parallel::register::Communicators, parallel::mesh::MeshError> {
    static COUNTED: Memo<parallel::register::Communicators> = OnceLock::new();
    memo(&COUNTED, Some(format!("{cfg:?}")), || {
        parallel::register::most_communicators(cfg)
    })
}

/// zbv's order on unit costs for `pp` stages, `m` micro-batches and `caps`, remembered: the cap
/// fits of many layouts (other widths, micro-batches, recomputation) walk the same schedules.
pub(super) fn unit_zbv(pp: usize, m: usize, caps: &[usize]) -> Result<Schedule, ScheduleError> {
    static BUILT: Memo<Schedule> = OnceLock::new();
    memo(&BUILT, Some(format!("{pp} {m} {caps:?}")), || {
        let fit = zbv::Fit {
            caps: caps.to_vec(),
            ..zbv::Fit::unit(pp)
        };
        build_zbv(pp, m, &fit)
    })
}

/// The parameters of a stage holding `layers` (and the embedding, the head, the first
/// `experts` experts of each MoE layer) and their elements on a tensor-parallel rank of `tp`,
/// remembered under `model_key` (the model and `tp`): stages of the same layers recur across
/// the layouts the search plans, and naming every parameter is most of building them.
pub(super) fn stage_parameters(
    model_key: &str,
    c: &model::LlamaConfig,
    (layers, embedding, head, experts): (&[usize], bool, bool, usize),
    tp: usize,
) -> Result<Arc<(Inventory, Vec<usize>)>, PlanError> {
    static BUILT: Memo<Arc<(Inventory, Vec<usize>)>> = OnceLock::new();
    let key = format!("{model_key} {layers:?} {embedding} {head} {experts}");
    memo(&BUILT, Some(key), || {
        let inventory = Inventory::with_experts(c, layers, embedding, head, 0..experts);
        let numels = inventory.local_numels(tp)?;
        Ok(Arc::new((inventory, numels)))
    })
}
