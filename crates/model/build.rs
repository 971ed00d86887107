//! Build script: with the `cuda` feature, compiles every `kernels/*.cu` file to PTX in `OUT_DIR`
//! (embedded by `src/ops/cuda/mod.rs`) with the `nvcc` on `PATH` (or `$NVCC`), for
//! `compute_$CUDA_COMPUTE_CAP` (default 90). The default build runs no compiler.

use std::path::PathBuf;
use std::process::Command;

/// The kernel sources, one PTX module each.
const MODULES: [&str; 4] = ["pointwise", "attention", "attention_tc", "flat"];

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(|c| c.is_ascii_digit()).collect();
    for m in MODULES {
        let src = format!("kernels/{m}.cu");
        println!("cargo:rerun-if-changed={src}");
        let ptx = out.join(format!("{m}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "-lineinfo"])
            .arg(format!("-arch=compute_{cap}"))
            .arg(&src)
            .arg("-o")
            .arg(&ptx)
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
}
