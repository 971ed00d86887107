#!/usr/bin/env bash
# One training step of the same model on CPU, candle (this project) against PyTorch eager, with
# the same thread count, in one run: ours with the hand-written backward passes (the default) and
# with autograd, PyTorch between them. Usage: bench/cpu_step.sh [recipe] [steps] [threads]
set -euo pipefail
cd "$(dirname "$0")/.."
RECIPE=${1:-recipes/tiny.yaml}
STEPS=${2:-10}
THREADS=${3:-$(nproc)}
VENV=bench/.venv
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import torch, yaml' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check torch pyyaml
fi
export RAYON_NUM_THREADS=$THREADS OMP_NUM_THREADS=$THREADS
cargo bench -q --bench cpu_step -- "$RECIPE" "$STEPS" hand_written > /tmp/candle_step.json
"$VENV/bin/python" bench/torch_llama.py "$RECIPE" "$STEPS" > /tmp/torch_step.json
cargo bench -q --bench cpu_step -- "$RECIPE" "$STEPS" autograd > /tmp/candle_autograd.json
python3 - /tmp/candle_step.json /tmp/torch_step.json /tmp/candle_autograd.json <<'PY'
import json, sys
c, t, a = (json.loads(open(p).read().strip().splitlines()[-1]) for p in sys.argv[1:4])
for r in (c, t, a):
    print(json.dumps(r))
print(f"forward: candle {c['fwd_ms']:.1f} ms, torch {t['fwd_ms']:.1f} ms -> torch/candle = {t['fwd_ms']/c['fwd_ms']:.2f}x")
print(f"step:    candle {c['step_ms']:.1f} ms, torch {t['step_ms']:.1f} ms -> torch/candle = {t['step_ms']/c['step_ms']:.2f}x (>1 means candle is faster)")
print(f"step with autograd backward: candle {a['step_ms']:.1f} ms -> torch/candle = {t['step_ms']/a['step_ms']:.2f}x; hand-written saves {100 * (1 - c['step_ms'] / a['step_ms']):.1f}%")
PY
