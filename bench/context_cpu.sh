#!/usr/bin/env bash
# What context parallelism buys and costs on CPU threads: the long-sequence recipe
# (recipes/tiny-long.yaml, 1024-token sequences) at cp = 1, 2, 4 and cp 2 × tp 2 with sequence
# parallelism, in one run: rank 0's peak of live activation bytes (what the step keeps for its
# backward passes, which the ring divides by cp), step time, and the ring's share — seconds in
# ring attention per step and, of those, the seconds the rank spent handing K/V blocks to the
# backend or waiting for its neighbour's (the transfer time not hidden behind the blocks'
# compute), and that share of the ring's time. All ranks share the machine's cores, so step times measure overhead, not speed-up.
# Usage: bench/context_cpu.sh [steps] [extra --set overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-8}
EXTRA=${2:-}
cargo build -q --release
BIN=target/release/pretrain
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
printf '%-52s %9s %10s %8s %9s %10s %8s\n' layout "ms/step" "acts MiB" "vs cp1" "ring ms" "exposed ms" exposed
base=""
for layout in "parallel.cp=1" "parallel.cp=2" "parallel.cp=4" \
              "parallel.cp=2,parallel.tp=2,parallel.sequence_parallel=true"; do
  dir="$OUT/$(echo "$layout" | tr ',=.' '___')"
  "$BIN" --recipe recipes/tiny-long.yaml \
    --set "train.steps=$STEPS,train.eval_interval=0,run.log_interval=1000,run.dir=$dir,$layout${EXTRA:+,$EXTRA}" >/dev/null 2>&1
  # Medians over the steps after the first two (warm-up).
  read -r ms acts ring exposed < <(python3 -c "
import json, statistics
rows = [json.loads(l) for l in open('$dir/metrics.jsonl') if 'step_time_s' in l][2:]
med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)
acts = max(r['act_peak_bytes'] for r in rows) / 2**20
print(f'{1000 * med(\"step_time_s\"):.0f} {acts:.2f} {1000 * med(\"ring_s\"):.0f} {1000 * med(\"ring_exposed_s\"):.0f}')")
  [ -z "$base" ] && base=$acts
  share=$(python3 -c "print('-' if $ring == 0 else f'{100 * $exposed / $ring:.0f}%')")
  printf '%-52s %9s %10s %8s %9s %10s %8s\n' "$layout" "$ms" "$acts" \
    "$(python3 -c "print(f'{$acts/$base:.2f}x')")" "$ring" "$exposed" "$share"
done
