#!/usr/bin/env bash
# What data and tensor parallelism cost on CPU threads: the tiny recipe's step time for the same
# global batch at several layouts, against one rank, in one run. All ranks share the machine's
# cores, so this measures the overhead of the parallel machinery (communication, sharded kernels,
# smaller matmuls), not a speed-up. Usage: bench/parallel_cpu.sh [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-20}
cargo build -q --release
BIN=target/release/pretrain
OUT=$(mktemp -d)
printf '%-48s %10s %10s %8s\n' layout "ms/step" "tok/s" "vs 1"
base=""
for layout in "parallel.dp=1" "parallel.dp=2" "parallel.dp=2,parallel.zero=1" "parallel.dp=4" \
              "parallel.tp=2" "parallel.tp=4" "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true"; do
  dir="$OUT/$(echo "$layout" | tr ',=.' '___')"
  "$BIN" --recipe recipes/tiny.yaml --set "train.steps=$STEPS,train.eval_interval=0,run.log_interval=1000,run.dir=$dir,$layout" >/dev/null 2>&1
  # Median step time over the steps after the first two (warm-up).
  ms=$(python3 -c "
import json,statistics,sys
t=[json.loads(l)['step_time_s'] for l in open('$dir/metrics.jsonl') if 'step_time_s' in l][2:]
print(f'{1000*statistics.median(t):.1f}')")
  [ -z "$base" ] && base=$ms
  tok=$(python3 -c "print(f'{32*128/($ms/1000):.0f}')")
  printf '%-48s %10s %10s %8s\n' "$layout" "$ms" "$tok" "$(python3 -c "print(f'{$ms/$base:.2f}x')")"
done
rm -rf "$OUT"
