#!/usr/bin/env bash
# CPU GEMM throughput on a training step's projection shapes: this project's (candle, the `gemm`
# crate; benches/gemm.rs) against NumPy's OpenBLAS on the same shapes and threads, in one run.
# Prints GFLOP/s per product (x wᵀ, g w, gᵀ x) and the ratio ours / OpenBLAS.
#
#   bench/gemm_cpu.sh [REPEATS]        PYTHON=python with numpy (default python3)
#
# OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are unset for the NumPy side: some machines set them to
# work around old OpenBLAS builds, and they make a current one pick slower kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
REPEATS=${1:-20}
PYTHON=${PYTHON:-python3}
THREADS=$(nproc)
OURS=$(cargo bench -q --bench gemm -- "$REPEATS" 2>/dev/null | grep '^{')
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS="$THREADS" \
  "$PYTHON" - "$REPEATS" "$OURS" <<'PY'
import json, statistics, sys, time
import numpy as np

repeats, ours = int(sys.argv[1]), json.loads(sys.argv[2])
try:
    import threadpoolctl
    blas = [f"{i['internal_api']} {i.get('version')} {i.get('architecture')} x{i['num_threads']}"
            for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
except ImportError:
    blas = ["(threadpoolctl not installed)"]
print(f"numpy {np.__version__}, BLAS: {', '.join(blas)}")


def median_s(f):
    f()
    t = []
    for _ in range(repeats):
        s = time.perf_counter()
        f()
        t.append(time.perf_counter() - s)
    return statistics.median(t)


rng = np.random.default_rng(0)
print(f"{'shape (rows x in -> out)':34} {'product':8} {'ours':>8} {'OpenBLAS':>9} {'ratio':>6}  GFLOP/s")
for name, r in ours.items():
    rows, n_in, n_out = r["rows"], r["in"], r["out"]
    x = rng.standard_normal((rows, n_in), dtype=np.float32)
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    g = rng.standard_normal((rows, n_out), dtype=np.float32)
    flops = 2.0 * rows * n_in * n_out
    theirs = {"fwd": median_s(lambda: x @ w.T), "dx": median_s(lambda: g @ w),
              "dw": median_s(lambda: g.T @ x)}
    for p, t in theirs.items():
        a, b = r[f"{p}_gflops"], flops / t / 1e9
        print(f"{name + f' ({rows} x {n_in} -> {n_out})':34} {p:8} {a:8.1f} {b:9.1f} {a / b:6.2f}")
PY
