#!/usr/bin/env bash
# Our loss curve beside PyTorch's from the same initial weights and batches, with AdamW and with
# Muon (+ AdamW for the rest): benches/torch_match.rs and bench/torch_match.py, f32 on the CPU.
# Usage: bench/torch_match.sh [recipe] [steps]; needs python3 with torch, pyyaml, safetensors
# (PYTHON=..., default bench/.venv, created when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
RECIPE=${1:-recipes/tiny.yaml}
STEPS=${2:-20}
VENV=bench/.venv
PYTHON=${PYTHON:-$VENV/bin/python}
if [ ! -x "$PYTHON" ] || ! "$PYTHON" -c 'import torch, yaml, safetensors' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check torch pyyaml safetensors
  PYTHON=$VENV/bin/python
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for opt in adamw muon; do
  cargo bench -q --bench torch_match -- "$RECIPE" "$STEPS" "$TMP/init.safetensors" "optimizer.name=$opt" > "$TMP/ours-$opt.json"
  "$PYTHON" bench/torch_match.py "$RECIPE" "$STEPS" "$TMP/init.safetensors" --set "optimizer.name=$opt" > "$TMP/torch-$opt.json"
done
python3 - "$TMP" <<'PY'
import json, sys
d = sys.argv[1]
for opt in ("adamw", "muon"):
    ours = json.load(open(f"{d}/ours-{opt}.json"))["losses"]
    theirs = json.load(open(f"{d}/torch-{opt}.json"))["losses"]
    rel = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
    print(f"{opt}: {len(ours)} steps, loss {ours[0]:.6f} -> {ours[-1]:.6f} (torch {theirs[0]:.6f} -> {theirs[-1]:.6f}), "
          f"max rel diff {max(rel):.2e} (step {rel.index(max(rel)) + 1})")
    print("  ours ", " ".join(f"{x:.5f}" for x in ours))
    print("  torch", " ".join(f"{x:.5f}" for x in theirs))
PY
