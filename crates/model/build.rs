//! Build script: with the `cuda` feature, compiles every `kernels/*.cu` file to a fat binary in
//! `OUT_DIR` (embedded by `src/ops/cuda/mod.rs`) with the `nvcc` on `PATH` (or `$NVCC`): machine
//! code (SASS) for `sm_$CUDA_COMPUTE_CAP` (default 90), so nothing is JIT-compiled on that GPU, plus
//! `compute_$CUDA_COMPUTE_CAP` PTX for newer ones. It also records the architecture and nvcc's CUDA
//! version (`PRETRAIN_CUDA_ARCH`, `PRETRAIN_CUDA_VERSION`, e.g. 90 and 13000) for the start-up
//! check against the driver and the GPU. It also compiles `cudnn/sdpa.cpp`, the C-ABI shim over
//! cuDNN's fused attention, with the system C++ compiler against the headers of the cuDNN
//! frontend (`$CUDNN_FRONTEND_INCLUDE_DIR`), cuDNN (`$CUDNN_INCLUDE_DIR`) and CUDA
//! (`$CUDA_HOME/include`); libcudnn itself is opened at run time. The default build runs no
//! compiler.

use std::path::PathBuf;
use std::process::Command;

/// The kernel sources, one PTX module each.
const MODULES: [&str; 5] = ["pointwise", "attention", "attention_tc", "flat", "fp8"];

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-changed=cudnn");
    for var in [
        "CUDNN_FRONTEND_INCLUDE_DIR",
        "CUDNN_INCLUDE_DIR",
        "CUDA_HOME",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(|c| c.is_ascii_digit()).collect();
    println!("cargo:rustc-env=PRETRAIN_CUDA_ARCH={cap}");
    println!(
        "cargo:rustc-env=PRETRAIN_CUDA_VERSION={}",
        cuda_version(&nvcc)
    );
    for m in MODULES {
        let src = format!("kernels/{m}.cu");
        println!("cargo:rerun-if-changed={src}");
        let fatbin = out.join(format!("{m}.fatbin"));
        let status = Command::new(&nvcc)
            .args(["--fatbin", "-O3", "-std=c++17", "-lineinfo"])
            .arg(format!("-gencode=arch=compute_{cap},code=sm_{cap}"))
            .arg(format!("-gencode=arch=compute_{cap},code=compute_{cap}"))
            .arg(&src)
            .arg("-o")
            .arg(&fatbin)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("{nvcc} failed on {src} ({s}); see its messages above"),
            Err(e) => panic!(
                "cannot run `{nvcc}` to compile {src}: {e}. The `cuda` feature needs the CUDA \
                 toolchain on PATH (scripts/build-cuda.sh sets it up)"
            ),
        }
    }
    cudnn_shim();
}

/// Compiles `cudnn/sdpa.cpp` into a static library linked into the crate (with libstdc++ and
/// libdl, which opens libcudnn at run time).
#[cfg(feature = "cuda")]
fn cudnn_shim() {
    let include = |var: &str, header: &str| -> PathBuf {
        let dir = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
            panic!(
                "${var} is not set: the `cuda` feature compiles cudnn/sdpa.cpp against {header} \
                 (scripts/build-cuda.sh sets it from the nvidia-cudnn-cu13 and \
                 nvidia-cudnn-frontend wheels)"
            )
        });
        let dir = if var == "CUDA_HOME" {
            dir.join("include")
        } else {
            dir
        };
        if !dir.join(header).is_file() {
            panic!("no {header} in {} (from ${var})", dir.display());
        }
        dir
    };
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .file("cudnn/sdpa.cpp")
        .define("NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING", None)
        .include(include("CUDNN_FRONTEND_INCLUDE_DIR", "cudnn_frontend.h"))
        .include(include("CUDNN_INCLUDE_DIR", "cudnn.h"))
        .include(include("CUDA_HOME", "cuda_runtime_api.h"))
        .flag_if_supported("-Wno-unused-function")
        .flag_if_supported("-Wno-unused-parameter")
        .compile("pretrain_cudnn_sdpa");
    println!("cargo:rustc-link-lib=dylib=dl");
}

#[cfg(not(feature = "cuda"))]
fn cudnn_shim() {}

/// nvcc's CUDA version as the driver API writes it (13.0 -> 13000), from `nvcc --version`.
fn cuda_version(nvcc: &str) -> u32 {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{nvcc} --version`: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    // "Cuda compilation tools, release 13.0, V13.0.88"
    let release = text
        .split("release ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap_or_else(|| panic!("no `release X.Y` in `{nvcc} --version`: {text}"));
    let mut parts = release.trim().split('.').map(|p| p.parse::<u32>());
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => major * 1000 + minor * 10,
        _ => panic!("cannot read the CUDA release `{release}` of `{nvcc} --version`"),
    }
}
