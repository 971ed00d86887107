#!/usr/bin/env bash
# One training step of the same model on CPU, candle (this project) against PyTorch eager, with
# the same thread count, in one run: ours, PyTorch, ours again (the two runs of ours bound the
# machine's drift). Usage: bench/cpu_step.sh [recipe] [steps] [threads]
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
cargo bench -q --bench cpu_step -- "$RECIPE" "$STEPS" > /tmp/candle_step.json
"$VENV/bin/python" bench/torch_llama.py "$RECIPE" "$STEPS" > /tmp/torch_step.json
cargo bench -q --bench cpu_step -- "$RECIPE" "$STEPS" > /tmp/candle_again.json
python3 - /tmp/candle_step.json /tmp/torch_step.json /tmp/candle_again.json <<'PY'
import json, sys
c, t, a = (json.loads(open(p).read().strip().splitlines()[-1]) for p in sys.argv[1:4])
for r in (c, t, a):
    print(json.dumps(r))
fwd = (c['fwd_ms'] + a['fwd_ms']) / 2
step = (c['step_ms'] + a['step_ms']) / 2
print(f"forward: candle {fwd:.1f} ms, torch {t['fwd_ms']:.1f} ms -> torch/candle = {t['fwd_ms']/fwd:.2f}x")
print(f"step:    candle {step:.1f} ms ({c['step_ms']:.1f}, {a['step_ms']:.1f}), torch {t['step_ms']:.1f} ms -> torch/candle = {t['step_ms']/step:.2f}x (>1 means candle is faster)")
PY
