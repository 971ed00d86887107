#!/usr/bin/env bash
# The pipeline schedules on CPU thread ranks: 1F1B, zb-h1 and zbv at p = 4 stages and m = 8
# micro-batches on one recipe (the tiny model made 16 layers deep, 32 sequences per step in
# micro-batches of 4), four layers per stage (zbv: two per chunk). Step 3 is traced (zbv runs
# the order fitted to step 2's costs from step 3 on); per schedule: the median step time, the traced
# step's measured bubble (idle share of the schedule phase, mean over the ranks) and the bubble
# the schedule has in the simulator on that step's measured action costs, the largest
# activation peak of any rank, and the mean forward / B / W durations of one chunk's action
# (a fused backward is B + W). The four ranks share this machine's two cores: an idle stage
# lends its core to the busy ones and every action slows when all four compute, so the measured
# bubble says little here; the simulated one is the schedule's own.
# Usage: bench/pipeline_cpu.sh [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-6}
cargo build -q --release
BIN=target/release/pretrain
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
COMMON="model.num_hidden_layers=16,train.global_batch=32,train.micro_batch=4,train.steps=$STEPS,train.eval_interval=0,run.log_interval=1000,run.trace_step=3,parallel.pp=4"
printf '%-8s %9s %8s %10s %14s %8s %8s %8s\n' schedule "ms/step" bubble simulated "act peak MiB" "F ms" "B ms" "W ms"
for s in "1f1b:parallel.pipeline_layout=[4, 4, 4, 4]" \
         "zb-h1:parallel.schedule=zb-h1,parallel.pipeline_layout=[4, 4, 4, 4]" \
         "zbv:parallel.schedule=zbv,parallel.virtual_stages=2"; do
  name=${s%%:*}
  dir="$OUT/$name"
  "$BIN" --recipe recipes/tiny.yaml --set "$COMMON,run.dir=$dir,${s#*:}" >/dev/null 2>&1
  python3 - "$dir" "$name" <<'PY'
import json, statistics, sys
d, name = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if "step_time_s" in l]
traced = next(r for r in rows if "bubble" in r)
ms = 1000 * statistics.median(r["step_time_s"] for r in rows[2:])
spans = [e for e in json.load(open(f"{d}/trace.json"))["traceEvents"] if e["ph"] == "X"]
def mean(prefix):
    d = [e["dur"] / 1000 for e in spans if e["name"].startswith(prefix)]
    return statistics.mean(d) if d else float("nan")
print(f"{name:<8} {ms:9.1f} {traced['bubble']:8.3f} {traced['bubble_simulated']:10.3f} {traced['act_peak_max_bytes'] / 2**20:14.2f} "
      f"{mean('F '):8.2f} {mean('B '):8.2f} {mean('W '):8.2f}")
PY
done
