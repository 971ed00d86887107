#!/usr/bin/env bash
# Builds the `cuda` variant of `pretrain` on a CPU-only x86_64 Linux machine with the CUDA 13.0
# toolchain taken from PyPI wheels, for sm_90 GPUs (H100/H200) whose driver is 580 (CUDA 13.0).
# The default build and CI need none of this.
#
#   scripts/build-cuda.sh                      # -> target/cuda/release/pretrain (features cuda,nccl)
#   CARGO_SUBCOMMAND=check scripts/build-cuda.sh   # type-check only
#
# Why these pins: the GPU machines' driver JITs PTX ISA <= 9.0, which nvcc 13.0 emits (newer nvcc
# emits newer PTX); cudarc reads the CUDA version from `nvcc --version`; candle-core links cudarc
# dynamically, so the linker needs unversioned lib*.so names and a libcuda.so — a stub here, the
# driver's real libcuda.so.1 at run time. cuDNN 9.19 (the version PyTorch 2.11 ships) and its
# frontend 1.19 give the headers of the fused-attention shim (crates/model/cudnn/sdpa.cpp); the
# binary opens libcudnn.so.9 at run time, only with `train.attention: cudnn` (the CUDA default).
#
# On the GPU machine, after copying the binary:
#   SP=$(python3 -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')   # a venv with the nvidia wheels
#   export LD_LIBRARY_PATH=$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:$SP/nvidia/cudnn/lib:${LD_LIBRARY_PATH:-}
#   ./pretrain --recipe recipes/1b.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
TC=${CUDA_TC_DIR:-$HOME/.cache/pretrain-cuda13}
FEATURES=${FEATURES:-cuda,nccl}
CARGO_SUBCOMMAND=${CARGO_SUBCOMMAND:-build}

[ -x "$TC/venv/bin/pip" ] || python3 -m venv "$TC/venv"
"$TC/venv/bin/pip" install -q --disable-pip-version-check \
  nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
  nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88 \
  nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-nccl-cu13==2.27.7 \
  nvidia-cudnn-cu13==9.19.0.56 nvidia-cudnn-frontend==1.19.1 nvidia-cuda-cupti==13.0.85
SP=$("$TC/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
CU=$SP/nvidia/cu13
NC=$SP/nvidia/nccl

L=$TC/link/lib
mkdir -p "$L"
for l in cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13 cudart.so.13; do
  ln -sf "$CU/lib/lib$l" "$L/lib${l%%.so*}.so"
done
ln -sf "$NC/lib/libnccl.so.2" "$L/libnccl.so"
if [ ! -f "$L/libcuda.so" ]; then
  cargo fetch -q
  CUDARC=$(cargo metadata -q --format-version 1 --features "$FEATURES" | python3 -c 'import json, sys, os
print(next(os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"))')
  # A stub libcuda.so: every driver entry point cudarc may call returns CUDA_ERROR_STUB_LIBRARY (34).
  grep -A3 'cfg(not(feature = "dynamic-loading"))' "$CUDARC/src/driver/sys/mod.rs" \
    | grep -oP '^\s+fn \K\w+(?=\()' | sort -u \
    | awk '{print "int " $1 "(void){return 34;}"}' > "$TC/link/libcuda_stub.c"
  gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$L/libcuda.so" "$TC/link/libcuda_stub.c"
fi

export PATH=$CU/bin:$PATH
export CUDA_HOME=$CU
export CUDNN_INCLUDE_DIR=$SP/nvidia/cudnn/include
export CUDNN_FRONTEND_INCLUDE_DIR=$SP/include
export CUDA_ROOT=$TC/link
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
cargo "$CARGO_SUBCOMMAND" --release --features "$FEATURES" "$@"
if [ "$CARGO_SUBCOMMAND" = build ]; then
  # The kernel-timeline preload of bench/gpu_check.sh's profile part, built here because the GPU
  # machines' Python environments lack the CUDA headers cupti.h includes; copy it beside the binary.
  cc -O2 -shared -fPIC -I"$CU/include" -o "$CARGO_TARGET_DIR/release/cupti_trace.so" \
    bench/cupti_trace.c -L"$CU/lib" -l:libcupti.so.13
  echo "built $CARGO_TARGET_DIR/release/pretrain and cupti_trace.so"
fi
