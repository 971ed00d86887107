//! `pretrain`: recipes, the optimizer, learning-rate schedules, the training loop and the
//! multi-process launcher. The model, parallelism, data and checkpoints live in the workspace
//! crates.

pub mod cli;
pub mod device;
pub mod eval;
pub mod faults;
pub mod files;
pub mod hf;
pub mod job;
pub mod launch;
pub mod lr;
pub mod optim;
pub mod plan;
pub mod recipe;
pub mod selftest;
pub mod train;

/// The process allocator: mimalloc keeps freed pages for reuse, where the system allocator returns
/// large activation buffers to the kernel after every op (measured: ~20% of a CPU training step in
/// page faults, zeroing and TLB shootdowns). The binary and the benchmarks install it with
/// `#[global_allocator] static GLOBAL: pretrain::Allocator = pretrain::Allocator {};`.
pub type Allocator = mimalloc::MiMalloc;

/// The spin limit given to candle's CPU worker pool (`CANDLE_BARRIER_POOL_SPIN_LIMIT`, in
/// `spin_loop` hints) unless the user set one. candle's default, 25,000, keeps each idle worker
/// spinning for about a millisecond after every parallel element-wise op; a training step runs
/// thousands of them, and on a machine with as many cores as compute threads the spinning worker
/// takes its core from the GEMM and kernel threads (measured: the tiny recipe's CPU step 377 ms
/// with candle's default, 281–302 ms with 100, docs/perf.md).
pub const CANDLE_SPIN_LIMIT: u32 = 100;

/// mimalloc's `mi_option_purge_delay` (`mimalloc.h`; the crate exports no constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Process-wide settings read from the environment by the libraries underneath, set before any of
/// them starts (the first thing `main` does; the benchmarks call it too). A setting the user made
/// is kept.
/// - mimalloc's purge delay = -1 (`MIMALLOC_PURGE_DELAY`): freed memory stays with the allocator
///   for the next allocation of its size instead of being returned to the OS a second after it
///   was freed. A training step frees and reallocates the same activation, gradient and
///   workspace sizes every micro-batch and layer; purged pages came back as fresh, zeroed
///   (huge) pages, 200–600 page faults and 8% of the samples per tiny step in kernel page
///   zeroing, none after (docs/perf.md). The process keeps its peak, as PyTorch's caching
///   allocator does;
/// - `RUST_LIB_BACKTRACE=0`: ordinary errors are reported by their messages (`RUST_BACKTRACE`
///   still gives panics theirs);
/// - `CANDLE_BARRIER_POOL_SPIN_LIMIT` = [`CANDLE_SPIN_LIMIT`];
/// - `RAYON_NUM_THREADS` = the physical cores: candle's CPU matmul asks for its thread count on
///   every call, and without this variable its default counts physical cores by reading and
///   parsing `/proc/cpuinfo` each time (`num_cpus::get_physical`, uncached) — 4.5% of a tiny-moe
///   step's samples; set, it is one environment read. The value is candle's own default, counted
///   once (rayon's pool then has as many threads as candle's GEMMs use); not set when the user
///   gave candle a CPU mask (`CANDLE_CPU_MASK`), which decides it then;
/// - with the `cuda` feature, `CUDA_MODULE_LOADING=EAGER`: every kernel of a module is loaded with
///   its module (when a device opens), not at its first launch. With lazy loading (the driver's
///   default since CUDA 12.2) a first launch can wait on a context-wide lock while NCCL kernels
///   spin waiting for peers. It must be set before the driver initialises;
/// - with the `nccl` feature, `NCCL_RUNTIME_CONNECT=0`: NCCL (2.22 and newer) otherwise connects
///   a communicator's peers, and allocates their buffers outside the CUDA memory pool, at the
///   first operation of each kind — inside step 1, right after its activation peak. Connected at
///   creation (`Comm::prepare`, before the first step), a communicator that does not fit fails at
///   start-up with NCCL's message, and the buffers count in the memory the pool can then take.
///
/// Call it while the process has one thread (setting the environment races with threads reading
/// it).
pub fn process_defaults() {
    // Options the environment set at load are kept (`set_default` leaves them).
    // SAFETY: a plain setter of mimalloc's option table, called while the process has one thread.
    unsafe { libmimalloc_sys::mi_option_set_default(MI_OPTION_PURGE_DELAY, -1) };
    let mut defaults = vec![
        ("RUST_LIB_BACKTRACE", "0".to_string()),
        (
            "CANDLE_BARRIER_POOL_SPIN_LIMIT",
            CANDLE_SPIN_LIMIT.to_string(),
        ),
    ];
    // A CPU mask given to candle sets its thread count instead.
    let unset = |key: &str| std::env::var_os(key).is_none();
    if unset("RAYON_NUM_THREADS") && unset("CANDLE_CPU_MASK") {
        let physical = num_cpus::get_physical().max(1);
        defaults.push(("RAYON_NUM_THREADS", physical.to_string()));
    }
    if cfg!(feature = "cuda") {
        defaults.push(("CUDA_MODULE_LOADING", "EAGER".to_string()));
        // More hardware queues than the default 8: a rank's streams (compute, one per NCCL
        // communicator) then rarely share one, where a kernel queued behind another stream's
        // waiting NCCL kernel would wait for it too.
        defaults.push(("CUDA_DEVICE_MAX_CONNECTIONS", "32".to_string()));
    }
    if cfg!(feature = "nccl") {
        defaults.push(("NCCL_RUNTIME_CONNECT", "0".to_string()));
    }
    for (key, value) in defaults {
        if unset(key) {
            std::env::set_var(key, value);
        }
    }
}
