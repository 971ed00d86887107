#!/usr/bin/env bash
# Attention forward + backward on one GPU: this project's backends (`pretrain bench-attention`:
# cudnn, own) against PyTorch's SDPA backends (bench/attention_sdpa.py: flash, cudnn) on the same
# shapes, inputs laid out as the model lays them out, in one run:
#   b 2, s 2048, 32/4 heads, d 64, causal   (the 1B recipes)
#   b 1, s 4096, 32/8 heads, d 128, causal
#   b 1, 8192 queries against 8192 keys, 32/8 heads, d 128, unmasked (a context-parallel ring block)
# and ours alone (torch's SDPA has no document mask) with documents kept apart:
#   b 2, s 2048, 32/4 heads, d 64, documents of 256 and of 64 positions (a ragged batch on cuDNN)
#
#   bench/attention_gpu.sh [PRETRAIN_BINARY]
#
# Environment: PYTHON (default /opt/torch/.venv/bin/python, torch with CUDA), ITERS (20), OUT
# (default runs/attention_gpu: one JSON per side and shape, and attention_gpu.json with every
# row and, per shape, ours / the fastest torch backend). Needs libcudnn.so.9 on LD_LIBRARY_PATH
# for the cudnn rows (the torch venv's nvidia/cudnn/lib; set here from PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(realpath "${1:-./pretrain}")
PYTHON=${PYTHON:-/opt/torch/.venv/bin/python}
ITERS=${ITERS:-20}
OUT=${OUT:-runs/attention_gpu}
mkdir -p "$OUT"
SP=$("$PYTHON" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
export LD_LIBRARY_PATH=$SP/nvidia/cu13/lib:$SP/nvidia/cudnn/lib:$SP/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

SHAPES=(
  "--batch 2 --seq 2048 --heads 32 --kv-heads 4 --head-dim 64"
  "--batch 1 --seq 4096 --heads 32 --kv-heads 8 --head-dim 128"
  "--batch 1 --seq 8192 --keys 8192 --heads 32 --kv-heads 8 --head-dim 128 --unmasked"
)
DOC_SHAPES=(
  "--batch 2 --seq 2048 --heads 32 --kv-heads 4 --head-dim 64 --documents 256"
  "--batch 2 --seq 2048 --heads 32 --kv-heads 4 --head-dim 64 --documents 64"
)
rc=0
for i in "${!DOC_SHAPES[@]}"; do
  # shellcheck disable=SC2086
  "$BIN" bench-attention --device cuda ${DOC_SHAPES[i]} --iters "$ITERS" --json "$OUT/docs-$i.json" || rc=1
done
for i in "${!SHAPES[@]}"; do
  # shellcheck disable=SC2086
  "$BIN" bench-attention --device cuda ${SHAPES[i]} --iters "$ITERS" --json "$OUT/ours-$i.json" || rc=1
  # shellcheck disable=SC2086
  "$PYTHON" bench/attention_sdpa.py ${SHAPES[i]} --iters "$ITERS" --json "$OUT/torch-$i.json" || rc=1
done
"$PYTHON" - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = [r for f in sorted(glob.glob(os.path.join(out, "*-[0-9].json"))) for r in json.load(open(f))]
summary = []
for shape in dict.fromkeys(r["shape"] for r in rows):
    these = [r for r in rows if r["shape"] == shape]
    torch = [r for r in these if r["backend"].startswith("torch-")]
    best = max(torch, key=lambda r: r["tflops"]) if torch else None
    for r in these:
        ratio = r["tflops"] / best["tflops"] if best else float("nan")
        summary.append(dict(r, vs_best_torch=ratio))
        vs = f"{ratio:5.2f}x of {best['backend']}" if best else "(no torch peer for this shape)"
        print(f"{shape:48} {r['backend']:>12} {r['tflops']:7.1f} TFLOP/s  {vs}")
json.dump(summary, open(os.path.join(out, "attention_gpu.json"), "w"), indent=2)
PY
exit $rc
