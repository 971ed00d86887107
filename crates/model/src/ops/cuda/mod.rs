//! CUDA side of the op library (feature `cuda`): the modules compiled from `kernels/*.cu` by the
//! build script (fat binaries: SASS for the build's architecture and PTX for newer ones), and the
//! helpers every launcher uses — loading every module once per CUDA context ([`load_all`], called
//! when a device opens, so no module is loaded inside a step), typed views of contiguous CUDA
//! storage, output allocation and launch shapes. `cudnn.rs` runs cuDNN's fused attention
//! through the C++ shim `cudnn/sdpa.cpp`, which the build script compiles.
//!
//! Kernel naming: a kernel templated on the storage type `T` is exported once per supported
//! dtype as `<base>_f32`, `<base>_f64` and `<base>_bf16` (see [`kernel_name`]); sums and
//! transcendental functions run in f32 (f64 for f64 storage) whatever `T` is.

pub mod attention;
mod attention_tc;
pub mod cudnn;
mod cudnn_ragged;
pub mod flat;
pub mod fp8;
pub mod grouped;
pub mod lt;
pub mod muon;
pub mod norm;
pub mod pointwise;
pub mod products;

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use candle_core::cuda::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaView, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda::cudarc::nvrtc::Ptx;
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{backend::BackendStorage, bail, DType, Layout, Result};

/// One kernel module of the project.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Module {
    /// `kernels/pointwise.cu`: RMSNorm, RoPE, SwiGLU, cross-entropy.
    Pointwise,
    /// `kernels/attention.cu`: causal flash attention forward and backward.
    Attention,
    /// `kernels/attention_tc.cu`: tensor-core (wmma) attention for bf16, head dim 64 and 128.
    AttentionTc,
    /// `kernels/flat.cu`: gradient accumulation, AdamW and sum of squares over flat buffers.
    Flat,
    /// `kernels/fp8.cu`: FP8 rounding by block (amax, cast).
    Fp8,
}

/// The GPU architecture the kernels were compiled for (`CUDA_COMPUTE_CAP` of the build, e.g. 90:
/// SASS for sm_90 and PTX for compute_90).
pub const BUILT_ARCH: u32 = parse_u32(env!("PRETRAIN_CUDA_ARCH"));

/// The CUDA version of the nvcc that compiled the kernels, as the driver API writes versions
/// (13.0 is 13000): the driver must support at least this version to load their PTX.
pub const BUILT_CUDA_VERSION: u32 = parse_u32(env!("PRETRAIN_CUDA_VERSION"));

const fn parse_u32(s: &str) -> u32 {
    let b = s.as_bytes();
    let (mut i, mut v) = (0, 0u32);
    while i < b.len() {
        v = v * 10 + (b[i] - b'0') as u32;
        i += 1;
    }
    v
}

impl Module {
    /// Every module.
    pub const ALL: [Module; 5] = [
        Module::Pointwise,
        Module::Attention,
        Module::AttentionTc,
        Module::Flat,
        Module::Fp8,
    ];

    /// The module's name (in error messages).
    pub fn name(self) -> &'static str {
        match self {
            Module::Pointwise => "pretrain-pointwise",
            Module::Attention => "pretrain-attention",
            Module::AttentionTc => "pretrain-attention-tc",
            Module::Flat => "pretrain-flat",
            Module::Fp8 => "pretrain-fp8",
        }
    }

    /// The module's fat binary.
    pub fn image(self) -> &'static [u8] {
        match self {
            Module::Pointwise => include_bytes!(concat!(env!("OUT_DIR"), "/pointwise.fatbin")),
            Module::Attention => include_bytes!(concat!(env!("OUT_DIR"), "/attention.fatbin")),
            Module::AttentionTc => {
                include_bytes!(concat!(env!("OUT_DIR"), "/attention_tc.fatbin"))
            }
            Module::Flat => include_bytes!(concat!(env!("OUT_DIR"), "/flat.fatbin")),
            Module::Fp8 => include_bytes!(concat!(env!("OUT_DIR"), "/fp8.fatbin")),
        }
    }
}

/// Loaded modules and their functions by name, per CUDA context (keyed by its handle). A module
/// holds its context, so a cached context stays alive and its handle is never reused.
#[derive(Default)]
struct Loaded {
    modules: HashMap<(usize, Module), LoadedModule>,
}

/// A loaded module and the functions looked up in it so far.
struct LoadedModule {
    module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

fn loaded() -> std::sync::MutexGuard<'static, Loaded> {
    static LOADED: LazyLock<Mutex<Loaded>> = LazyLock::new(Mutex::default);
    LOADED.lock().unwrap_or_else(|e| e.into_inner())
}

/// `module` in the context of `dev` with its functions looked up so far, loaded on first use (the
/// caller holds the cache's lock).
fn module_in<'c>(
    cache: &'c mut Loaded,
    dev: &CudaDevice,
    module: Module,
) -> Result<&'c mut LoadedModule> {
    let ctx = dev.cuda_stream().context().clone();
    let key = (ctx.cu_ctx() as usize, module);
    if cache.modules.contains_key(&key) {
        return Ok(cache.modules.get_mut(&key).expect("present"));
    }
    // A copy: the driver reads the image through an aligned pointer.
    let image = Ptx::from_binary(module.image().to_vec());
    let m = ctx.load_module(image).map_err(|e| {
        candle_core::Error::Msg(format!(
            "loading the CUDA module {} (built for sm_{BUILT_ARCH} with CUDA {}.{}): {e}",
            module.name(),
            BUILT_CUDA_VERSION / 1000,
            BUILT_CUDA_VERSION % 1000 / 10
        ))
    })?;
    Ok(cache.modules.entry(key).or_insert(LoadedModule {
        module: m,
        functions: HashMap::new(),
    }))
}

/// Loads every module of the project into the context of `dev` (once per context). Called when a
/// device opens, so that no module is loaded — and nothing can wait on a driver lock — while
/// kernels of a step, or collectives, are in flight.
pub fn load_all(dev: &CudaDevice) -> Result<()> {
    {
        let mut cache = loaded();
        for m in Module::ALL {
            module_in(&mut cache, dev, m)?;
        }
    }
    load_candle_modules(dev)
}

/// candle's own kernel modules that training launches (its casts, fills, copies, index, reduce,
/// affine, unary, binary and select kernels), each through one of its kernels: candle ships them
/// as PTX, which the driver compiles when a module first loads — otherwise inside step 1, with
/// NCCL kernels possibly in flight. (Its convolution, quantized and sort modules are never used.)
fn load_candle_modules(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda::kernels as k;
    let modules = [
        (&k::AFFINE, "affine_f32"),
        (&k::BINARY, "badd_f32"),
        (&k::CAST, "cast_f32_bf16"),
        (&k::FILL, "fill_f32"),
        (&k::INDEXING, "is_u32_f32"),
        (&k::REDUCE, "fast_sum_f32"),
        (&k::TERNARY, "where_u8_f32"),
        (&k::UNARY, "ucopy_f32"),
    ];
    for (module, kernel) in modules {
        dev.get_or_load_func(kernel, module).map_err(|e| {
            candle_core::Error::Msg(format!("loading candle's CUDA kernel {kernel}: {e}"))
        })?;
    }
    Ok(())
}

/// `<base>_<dtype>` for the dtypes the kernels are instantiated for (f32, f64, bf16); any other
/// dtype is an error naming `op`.
pub fn kernel_name(op: &str, base: &str, dtype: DType) -> Result<String> {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::BF16 => "bf16",
        d => bail!("{op}: no CUDA kernel for dtype {d:?} (f32, f64 and bf16 are supported)"),
    };
    Ok(format!("{base}_{suffix}"))
}

/// Kernel `name` of `module` in the context of `dev`, looked up once per context (launch it with
/// the device stream's `launch_builder`).
pub fn load(dev: &CudaDevice, module: Module, name: &str) -> Result<CudaFunction> {
    let mut cache = loaded();
    let loaded = module_in(&mut cache, dev, module)?;
    if let Some(f) = loaded.functions.get(name) {
        return Ok(f.clone());
    }
    let f = loaded.module.load_function(name).map_err(|e| {
        candle_core::Error::Msg(format!("CUDA kernel {name} of {}: {e}", module.name()))
    })?;
    loaded.functions.insert(name.to_string(), f.clone());
    Ok(f)
}

/// `n` as an `i32` kernel argument; errors (naming `op` and `what`) if it does not fit.
pub fn to_i32(op: &str, what: &str, n: usize) -> Result<i32> {
    match i32::try_from(n) {
        Ok(v) => Ok(v),
        Err(_) => bail!(
            "{op}: {what} = {n} exceeds the CUDA kernels' limit of {}",
            i32::MAX
        ),
    }
}

/// A storage type of the kernels and its accumulation type (`Acc<T>` in `common.cuh`).
pub trait KernelFloat: CudaDType + DeviceRepr {
    /// f32 for f32 and bf16, f64 for f64.
    type Acc: CudaDType + DeviceRepr + ValidAsZeroBits;
    /// `x` as a kernel argument of the accumulation type.
    fn acc(x: f64) -> Self::Acc;
}

impl KernelFloat for f32 {
    type Acc = f32;
    fn acc(x: f64) -> f32 {
        x as f32
    }
}

impl KernelFloat for f64 {
    type Acc = f64;
    fn acc(x: f64) -> f64 {
        x
    }
}

impl KernelFloat for half::bf16 {
    type Acc = f32;
    fn acc(x: f64) -> f32 {
        x as f32
    }
}

/// The dtype of `Acc<T>` for storage dtype `dtype`: f64 for f64, f32 otherwise.
pub fn acc_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The contiguous data of `(storage, layout)` as a typed device view; errors (naming `op` and
/// the argument `name`) on a dtype mismatch or a non-contiguous layout.
pub fn view<'a, T: CudaDType + DeviceRepr>(
    op: &str,
    name: &str,
    storage: &'a CudaStorage,
    layout: &Layout,
) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{op}: `{name}` must be contiguous on CUDA (layout {layout:?})")
    };
    let data: &CudaSlice<T> = match storage.as_cuda_slice::<T>() {
        Ok(d) => d,
        Err(_) => bail!(
            "{op}: `{name}` has dtype {:?}, expected {:?}",
            storage.dtype(),
            std::any::type_name::<T>()
        ),
    };
    Ok(data.slice(start..end))
}

/// A fresh, uninitialised device buffer of `len` elements of `T`.
///
/// # Safety
/// Every element must be written before it is read.
pub unsafe fn alloc<T: DeviceRepr>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: forwarded to the caller.
    unsafe { dev.alloc::<T>(len.max(1)) }
}

/// A device buffer of `len` zeros of `T`.
pub fn zeros<T: DeviceRepr + candle_core::cuda::cudarc::driver::ValidAsZeroBits>(
    dev: &CudaDevice,
    len: usize,
) -> Result<CudaSlice<T>> {
    dev.alloc_zeros::<T>(len.max(1))
}

/// `blocks` blocks of `threads` threads with `shared` bytes of dynamic shared memory.
pub fn grid(blocks: usize, threads: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// Enough 256-thread blocks for one thread per element of `n` (grid-stride kernels cap it).
pub fn elementwise(n: usize) -> LaunchConfig {
    grid(n.div_ceil(256).min(65_535 * 16), 256, 0)
}

/// Runs `$body` with `$T` bound to the Rust element type of `$dtype` (f32, f64 or bf16); other
/// dtypes are an error naming `$op`.
#[macro_export]
#[doc(hidden)]
macro_rules! with_cuda_dtype {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $T = f64;
                $body
            }
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            d => candle_core::bail!("{}: no CUDA kernel for dtype {d:?}", $op),
        }
    };
}
