#!/usr/bin/env bash
# What data and tensor parallelism and the ZeRO stages cost on CPU threads: the tiny recipe's step
# time for the same global batch at several layouts, against one rank, in one run, with rank 0's
# persistent state (parameters + gradients + optimizer), its peak per-piece buffers (gathered
# parameters + staged gradients) and, at ZeRO-3, the share of all-gather time hidden behind
# compute. All ranks share the machine's cores, so this measures the overhead of the parallel
# machinery (communication, sharded kernels, smaller matmuls), not a speed-up.
# Usage: bench/parallel_cpu.sh [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-20}
cargo build -q --release
BIN=target/release/pretrain
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
printf '%-58s %9s %8s %6s %9s %9s %7s\n' layout "ms/step" "tok/s" "vs 1" "state MiB" "units MiB" hidden
base=""
for layout in "parallel.dp=1" "parallel.dp=2" "parallel.dp=2,parallel.zero=1" "parallel.dp=4" \
              "parallel.tp=2" "parallel.tp=4" "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true" \
              "parallel.dp=4,parallel.zero=1" "parallel.dp=4,parallel.zero=2" "parallel.dp=4,parallel.zero=3" \
              "parallel.dp=4,parallel.zero=3,train.recompute=full" \
              "parallel.dp=4,parallel.zero=3,parallel.zero_shard_size=2"; do
  dir="$OUT/$(echo "$layout" | tr ',=.' '___')"
  "$BIN" --recipe recipes/tiny.yaml --set "train.steps=$STEPS,train.eval_interval=0,run.log_interval=1000,run.dir=$dir,$layout" >/dev/null 2>&1
  # Medians over the steps after the first two (warm-up).
  read -r ms state units hidden < <(python3 -c "
import json, statistics
rows = [json.loads(l) for l in open('$dir/metrics.jsonl') if 'step_time_s' in l][2:]
med = lambda k: statistics.median(r[k] for r in rows)
state = rows[-1]['param_bytes'] + rows[-1]['grad_bytes'] + rows[-1]['optimizer_bytes']
units = max(r['param_unit_peak_bytes'] + r['grad_unit_peak_bytes'] for r in rows)
hidden = f\"{100 * med('gather_hidden'):.0f}%\" if 'gather_hidden' in rows[-1] else '-'
print(f'{1000 * med(\"step_time_s\"):.1f} {state / 2**20:.2f} {units / 2**20:.2f} {hidden}')")
  [ -z "$base" ] && base=$ms
  tok=$(python3 -c "print(f'{32*128/($ms/1000):.0f}')")
  printf '%-58s %9s %8s %6s %9s %9s %7s\n' "$layout" "$ms" "$tok" "$(python3 -c "print(f'{$ms/$base:.2f}x')")" \
    "$state" "$units" "$hidden"
done
