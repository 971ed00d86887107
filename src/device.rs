//! The compute device of a run: opening it ([`device_for`]), waiting for its queued work
//! ([`synchronize`]), its memory in use ([`memory`]) and the largest activations its kernels can
//! index ([`element_problems`]).
//!
//! Opening a CUDA device does, in this order, everything that must not happen inside a step:
//! the driver's CUDA version and the GPU's compute capability are checked against what the
//! kernels were built for (an error names both), the device gets a stream of its own (shared by
//! every thread-rank and the communication thread of this process), cudarc's per-allocation event
//! tracking is turned off, the memory pool is told to keep freed memory, and every kernel module of
//! the project, and those of candle's that training launches, is loaded.
//!
//! Why event tracking can be off: cudarc records two CUDA events per allocation and a wait and a
//! record per kernel argument once a context has a second stream, to order buffers used on several
//! streams. Every tensor op of this process runs on the one device stream, which orders them by
//! itself; the only other streams are the NCCL communicators', and the NCCL backend orders those
//! explicitly (its stream waits on an event recorded on the device stream after the inputs are
//! made, and inputs and outputs are kept alive until the operation's completion event has fired).
//! Tracking would add host work to every op (tens of microseconds each) for no ordering.

use anyhow::Result;
use candle_core::{Device, Tensor};

use model::AttentionBackend;

use crate::recipe::DeviceKind;

/// Makes attention `backend` ready to run: for `cudnn`, opens libcudnn (once per process; an
/// error names the library and the fix when it cannot be). Returns how the log names it, e.g.
/// `cudnn 9.19.0` or `own`.
pub fn prepare_attention(backend: AttentionBackend) -> Result<String> {
    if backend == AttentionBackend::Own {
        return Ok(backend.to_string());
    }
    #[cfg(feature = "cuda")]
    {
        let v = model::ops::cuda::cudnn::load()?;
        let (major, minor, patch) = (v / 10_000, v / 100 % 100, v % 100);
        let backward = match backend.deterministic() {
            true => "",
            false => ", non-deterministic backward (train.deterministic: false)",
        };
        Ok(format!("cudnn {major}.{minor}.{patch}{backward}"))
    }
    #[cfg(not(feature = "cuda"))]
    anyhow::bail!(
        "train.attention is cudnn but this binary was built without the `cuda` feature \
         (scripts/build-cuda.sh builds it)"
    )
}

/// Refuses `fp8` on a GPU that cannot run it (the CPU runs the emulated path).
pub fn check_fp8(device: &Device, fp8: &crate::recipe::Fp8Config) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let (major, minor) = d.cuda_stream().context().compute_capability()?;
        if let Some(p) = crate::recipe::fp8_device_problem((major * 10 + minor) as u32, fp8) {
            anyhow::bail!(p);
        }
    }
    let _ = (device, fp8);
    Ok(())
}

/// The number of CUDA devices this machine shows (0 in a build without the `cuda` feature).
pub fn gpu_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda::cudarc::driver::CudaContext;
        let n = CudaContext::device_count().map_err(|e| anyhow::anyhow!("counting GPUs: {e}"))?;
        Ok(n.max(0) as usize)
    }
    #[cfg(not(feature = "cuda"))]
    Ok(0)
}

/// The GPU a process of a multi-process job uses: its local rank among the GPUs it sees when
/// it sees one per local rank (torchrun; Slurm with every GPU of the node visible), GPU 0 when it
/// sees exactly one (Slurm's `--gpus-per-task=1`, or `CUDA_VISIBLE_DEVICES` set per process).
/// Anything else is an error naming the numbers and the variable that decides them.
pub fn gpu_ordinal(local_rank: usize, visible: usize) -> Result<usize> {
    match visible {
        0 => anyhow::bail!("local rank {local_rank}: no GPU is visible to this process"),
        1 => Ok(0),
        n if local_rank < n => Ok(local_rank),
        n => anyhow::bail!(
            "local rank {local_rank} has no GPU of its own: this process sees {n} GPUs \
             (CUDA_VISIBLE_DEVICES={}); give each process either every GPU of its node (one \
             process per GPU, local ranks 0..{n}) or exactly one",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
        ),
    }
}

/// Opens the GPU of local rank `local_rank` ([`gpu_ordinal`] over the GPUs this process sees)
/// and says in the log which one it took.
pub fn open_local_gpu(rank: usize, local_rank: usize) -> Result<Device> {
    let visible = gpu_count()?;
    let ordinal = gpu_ordinal(local_rank, visible)?;
    let device = device_for(DeviceKind::Cuda, ordinal)?;
    tracing::info!(
        "rank {rank} (local rank {local_rank}): GPU {ordinal} of the {visible} it sees \
         (CUDA_VISIBLE_DEVICES={})",
        std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
    );
    Ok(device)
}

/// The compute device a recipe asks for; `ordinal` picks the GPU. See the module docs for what
/// opening a CUDA device checks and prepares.
pub fn device_for(kind: DeviceKind, ordinal: usize) -> Result<Device> {
    match kind {
        DeviceKind::Cpu => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => cuda::open(ordinal),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => {
            let _ = ordinal;
            anyhow::bail!(
                "train.device is cuda but this binary was built without the `cuda` feature"
            )
        }
    }
}

/// Waits until the work queued on `device` is done (nothing to wait for on the CPU): step times
/// are read after it, so they measure the GPU's work rather than its enqueueing.
pub fn synchronize(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        d.cuda_stream().synchronize()?;
    }
    let _ = device;
    Ok(())
}

/// Most elements a tensor that candle's CUDA kernels process whole may have: they walk their
/// elements with a 32-bit grid-stride index, so a larger tensor would be processed in part or
/// the walk would never end. The flat buffers (gradients, optimizer state, parameters) are
/// processed in spans of this size (`optim::spans`) or by the project's own kernels, which
/// index with 64 bits; activations are not.
pub const CUDA_MAX_ELEMENTS: usize = crate::optim::spans::SPAN;

/// A zero tensor `[n]` of f32 on `device` for the large buffer `what` (gradients, optimizer
/// state), allocated fallibly: where the memory cannot be had, an error naming the buffer and its
/// size instead of an abort. On the CPU the pages are the allocator's lazily zeroed ones, as
/// `Tensor::zeros` gives them.
pub fn zeros_f32(what: &str, n: usize, device: &Device) -> candle_core::Result<Tensor> {
    let fail = |e: &dyn std::fmt::Display| {
        candle_core::Error::Msg(format!(
            "cannot allocate {what} ({:.2} GiB): {e}",
            n as f64 * 4.0 / (1u64 << 30) as f64
        ))
    };
    if !device.is_cpu() || n == 0 {
        return Tensor::zeros(n, candle_core::DType::F32, device).map_err(|e| fail(&e));
    }
    let layout = std::alloc::Layout::array::<f32>(n).map_err(|e| fail(&e))?;
    // SAFETY: `layout` has a non-zero size (n > 0); a null result is the failure checked below.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
    if ptr.is_null() {
        return Err(fail(&"out of memory"));
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `n` f32s, all of
    // them zeroed (a valid f32), and is owned by the vector from here on.
    let v = unsafe { Vec::from_raw_parts(ptr, n, n) };
    Tensor::from_vec(v, n, device)
}

/// The problems, each naming its tensor and a remedy, of the tensors of one rank of `recipe`'s
/// layout that candle's CUDA kernels process whole and whose element counts they bound
/// ([`CUDA_MAX_ELEMENTS`]): the logits and the MLP activations of a micro-batch. (The flat
/// buffers have no bound: they are processed in spans.) The trainer checks its rank with this at
/// start-up and the planner every layout it ranks, so nothing ranked is refused.
pub fn element_problems(recipe: &crate::recipe::Recipe) -> Vec<String> {
    let (t, p, m) = (&recipe.train, &recipe.parallel, &recipe.model);
    let rows = (t.micro_batch * t.seq_len / p.cp.max(1)) as u64;
    let tp = p.tp.max(1) as u64;
    let counts = [
        (
            "the logits of a micro-batch",
            rows * m.vocab_size as u64 / tp,
        ),
        (
            "the MLP's gate and up projections of a micro-batch (one joined tensor)",
            rows * 2 * m.intermediate_size as u64 / tp,
        ),
        (
            "the q, k and v projections of a micro-batch (one fused GEMM's output)",
            rows * (m.q_dim() + 2 * m.num_key_value_heads * m.head_dim()) as u64 / tp,
        ),
    ];
    let limit = CUDA_MAX_ELEMENTS as u64;
    counts
        .into_iter()
        .filter(|&(_, n)| n > limit)
        .filter_map(|(what, n)| check_elements_within(what, n as usize, limit as usize).err())
        .map(|e| e.to_string())
        .collect()
}

/// Errors, naming `what` and a remedy, if a tensor of `n` elements exceeds `limit`.
pub fn check_elements_within(what: &str, n: usize, limit: usize) -> candle_core::Result<()> {
    if n > limit {
        candle_core::bail!(
            "{what} would have {n} elements on this rank, more than the {limit} that CUDA kernels \
             indexing with 32 bits can address; spread it over more ranks: a smaller \
             train.micro_batch, or more tensor or context parallelism"
        );
    }
    Ok(())
}

/// Bytes allocated on a device, now and at the peak since the last [`reset_peak`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceMemory {
    /// Bytes in use now.
    pub current: u64,
    /// Most bytes in use at once.
    pub peak: u64,
    /// Bytes the pool holds from the driver: the most ever in use at once, since the pool keeps
    /// freed memory (start-up's peak included); what other processes cannot have.
    pub reserved: u64,
    /// Device memory in use beyond what the pool holds: the CUDA context, loaded kernels,
    /// library workspaces and NCCL's buffers (and other processes' memory on a shared GPU). What
    /// the planner's headroom (`plan::Hardware::headroom_bytes`) stands for, measured.
    pub outside_pool: u64,
}

/// [`DeviceMemory::outside_pool`] from the driver's `total` and `free` bytes and the pool's
/// `reserved` bytes.
pub fn outside_pool(total: u64, free: u64, reserved: u64) -> u64 {
    total.saturating_sub(free).saturating_sub(reserved)
}

/// The memory in use on `device` through its memory pool (every tensor of the process), or `None`
/// on the CPU.
pub fn memory(device: &Device) -> Option<DeviceMemory> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return cuda::memory(d).ok();
    }
    let _ = device;
    None
}

/// The memory a job on `device` may use: on the CPU the host's `MemAvailable` (what can be
/// allocated without swapping), on CUDA the GPU's free memory now; `None` when it cannot be read.
pub fn capacity(device: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return cuda::free_memory(d).ok();
    }
    let _ = device;
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    mem_available(&meminfo)
}

/// What the driver says of this node's GPUs, without creating a context on any: the first
/// visible one's name and total memory, and how many are visible.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuFacts {
    /// The device's name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Its memory, bytes (what CUDA reports: about 79.6 GiB on an H100 80GB).
    pub total: u64,
    /// GPUs visible to this process.
    pub count: usize,
}

/// [`GpuFacts`] of this node, or `None` without a GPU (or a build without CUDA).
pub fn gpu_facts() -> Option<GpuFacts> {
    #[cfg(feature = "cuda")]
    return cuda::facts().ok();
    #[cfg(not(feature = "cuda"))]
    None
}

/// `MemAvailable` of a `/proc/meminfo` text, bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Starts a new peak for [`memory`] at the bytes in use now.
pub fn reset_peak(device: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let _ = cuda::reset_peak(d);
    }
    let _ = device;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_outside_the_pool_is_what_the_driver_counts_beyond_it() {
        let gib = 1u64 << 30;
        // 80 GiB, 50 free, the pool holding 28: 2 GiB elsewhere (context, libraries, NCCL).
        assert_eq!(outside_pool(80 * gib, 50 * gib, 28 * gib), 2 * gib);
        // Read at different instants the figures may cross; never below zero.
        assert_eq!(outside_pool(80 * gib, 60 * gib, 28 * gib), 0);
        assert_eq!(outside_pool(80 * gib, 81 * gib, 0), 0);
    }

    #[test]
    fn available_memory_is_read_from_meminfo() {
        let text =
            "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available(text), Some(20_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);
        assert!(capacity(&Device::Cpu).is_some_and(|b| b > 0));
    }

    #[test]
    fn each_local_rank_takes_its_own_gpu_or_the_only_one_it_sees() {
        // torchrun / Slurm with the node's GPUs visible: local rank = ordinal.
        assert_eq!(gpu_ordinal(3, 8).unwrap(), 3);
        assert_eq!(gpu_ordinal(0, 8).unwrap(), 0);
        // Slurm --gpus-per-task=1: each process sees one GPU, ordinal 0 whatever its local rank.
        assert_eq!(gpu_ordinal(5, 1).unwrap(), 0);
        let e = gpu_ordinal(5, 4).unwrap_err().to_string();
        assert!(e.contains("local rank 5 has no GPU of its own"), "{e}");
        assert!(e.contains("sees 4 GPUs"), "{e}");
        assert!(e.contains("CUDA_VISIBLE_DEVICES="), "{e}");
        let e = gpu_ordinal(0, 0).unwrap_err().to_string();
        assert!(e.contains("no GPU is visible"), "{e}");
    }

    #[test]
    fn large_buffers_are_allocated_fallibly() {
        let t = zeros_f32("the test buffer", 1000, &Device::Cpu).unwrap();
        assert_eq!(t.to_vec1::<f32>().unwrap(), vec![0f32; 1000]);
        assert_eq!(zeros_f32("empty", 0, &Device::Cpu).unwrap().elem_count(), 0);
        // More than any address space: an error naming the buffer, not an abort.
        let e = zeros_f32("the AdamW state", usize::MAX / 8, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot allocate the AdamW state"), "{e}");
    }

    #[test]
    fn tensors_past_the_index_limit_are_refused_by_name() {
        assert!(check_elements_within("x", 10, 10).is_ok());
        let e = check_elements_within("the logits of a micro-batch", 11, 10)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the logits of a micro-batch would have 11 elements"),
            "{e}"
        );
        assert!(e.contains("more than the 10"), "{e}");
        assert!(e.contains("train.micro_batch"), "{e}");
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use anyhow::{bail, Context, Result};
    use candle_core::cuda::cudarc::driver::{result, sys, CudaContext};
    use candle_core::cuda::CudaDevice;
    use candle_core::Device;
    use model::ops::cuda::{BUILT_ARCH, BUILT_CUDA_VERSION};

    use super::DeviceMemory;

    fn version(v: u32) -> String {
        format!("{}.{}", v / 1000, v % 1000 / 10)
    }

    /// The checks and preparations of the module docs, in their order.
    pub(super) fn open(ordinal: usize) -> Result<Device> {
        // SAFETY: plain driver queries with valid out-pointers.
        let driver = unsafe {
            result::init().context("initialising the CUDA driver")?;
            let mut v = 0i32;
            sys::cuDriverGetVersion(&mut v)
                .result()
                .context("reading the CUDA driver's version")?;
            v as u32
        };
        if driver < BUILT_CUDA_VERSION {
            bail!(
                "the CUDA driver supports CUDA {} but this binary's kernels were built with CUDA {} \
                 and need a driver for CUDA {} or newer (update the driver, or build with an older \
                 nvcc: scripts/build-cuda.sh)",
                version(driver),
                version(BUILT_CUDA_VERSION),
                version(BUILT_CUDA_VERSION)
            );
        }
        let ctx =
            CudaContext::new(ordinal).with_context(|| format!("opening CUDA device {ordinal}"))?;
        let (major, minor) = ctx.compute_capability()?;
        let cap = (major * 10 + minor) as u32;
        if cap < BUILT_ARCH {
            let name = ctx.name().unwrap_or_else(|_| "?".into());
            bail!(
                "CUDA device {ordinal} ({name}) has compute capability {major}.{minor}; this \
                 binary's kernels were built for {}.{} and newer (rebuild with \
                 CUDA_COMPUTE_CAP={cap} scripts/build-cuda.sh)",
                BUILT_ARCH / 10,
                BUILT_ARCH % 10
            );
        }
        drop(ctx);
        let device = Device::new_cuda_with_stream(ordinal)
            .with_context(|| format!("opening CUDA device {ordinal}"))?;
        let Device::Cuda(d) = &device else {
            unreachable!("new_cuda_with_stream gives a CUDA device")
        };
        // SAFETY: no tensor exists on this device yet; see the module docs for why the one
        // device stream and the NCCL backend's own events make the tracking redundant.
        unsafe { d.disable_event_tracking() };
        keep_freed_memory(d).context("configuring the CUDA memory pool")?;
        model::ops::cuda::load_all(d).context("loading the project's CUDA kernels")?;
        Ok(device)
    }

    fn pool(d: &CudaDevice) -> Result<sys::CUmemoryPool> {
        let dev = d.cuda_stream().context().cu_device();
        // SAFETY: `dev` is the device handle of an open context.
        Ok(unsafe { result::device::get_mem_pool(dev)? })
    }

    /// Freed memory stays in the pool instead of being returned to the driver at every
    /// synchronisation (the default threshold is 0), so allocations after a host read are cheap.
    fn keep_freed_memory(d: &CudaDevice) -> Result<()> {
        use sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        set_attribute(d, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)
    }

    fn set_attribute(d: &CudaDevice, attr: sys::CUmemPool_attribute, mut v: u64) -> Result<()> {
        // SAFETY: a valid pool and a u64 for a u64 attribute.
        unsafe { result::mem_pool::set_attribute(pool(d)?, attr, &mut v as *mut u64 as *mut _)? };
        Ok(())
    }

    fn attribute(d: &CudaDevice, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: a valid pool and a u64 for a u64 attribute.
        unsafe { result::mem_pool::get_attribute(pool(d)?, attr, &mut v as *mut u64 as *mut _)? };
        Ok(v)
    }

    pub(super) fn memory(d: &CudaDevice) -> Result<DeviceMemory> {
        use sys::CUmemPool_attribute::*;
        let reserved = attribute(d, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        d.cuda_stream().context().bind_to_thread()?;
        let (free, total) = result::mem_get_info()?;
        Ok(DeviceMemory {
            current: attribute(d, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            peak: attribute(d, CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved,
            outside_pool: super::outside_pool(total as u64, free as u64, reserved),
        })
    }

    pub(super) fn facts() -> Result<super::GpuFacts> {
        result::init()?;
        let count = result::device::get_count()?;
        if count < 1 {
            bail!("no CUDA device visible");
        }
        let dev = result::device::get(0)?;
        // SAFETY: `dev` was returned by `get`.
        let total = unsafe { result::device::total_mem(dev)? };
        Ok(super::GpuFacts {
            name: result::device::get_name(dev)?,
            total: total as u64,
            count: count as usize,
        })
    }

    pub(super) fn free_memory(d: &CudaDevice) -> Result<u64> {
        d.cuda_stream().context().bind_to_thread()?;
        let (free, _total) = result::mem_get_info()?;
        Ok(free as u64)
    }

    pub(super) fn reset_peak(d: &CudaDevice) -> Result<()> {
        // Setting the high-water mark (to 0) resets it to the bytes in use now.
        set_attribute(
            d,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            0,
        )
    }
}
