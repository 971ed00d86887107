#!/usr/bin/env bash
# GPU memory over a run's life: nvidia-smi's memory.used sampled every 50 ms beside the run's own
# per-step log (pool, peak and outside-pool figures), both timestamped, so that what the GPU holds
# beyond the memory pool can be placed in time (start-up, the first step, shutdown).
#
#   bench/memory_timeline.sh PRETRAIN_BINARY NAME [--set ...]
#
# Runs recipes/bench-1b.yaml (10 steps, a log line per step) with the given extra arguments and
# writes $OUT/NAME.mem (nvidia-smi: "timestamp, MiB"), $OUT/NAME.log (the run's log) and prints
# the largest sample and the timestamps where memory.used first and last reached it.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 PRETRAIN_BINARY NAME [--set ...]" >&2; exit 2; }
BIN=$(realpath "$1")
NAME=$2
shift 2
OUT=${OUT:-runs/memory_timeline}
mkdir -p "$OUT"
rm -rf "/tmp/memory_timeline/$NAME"
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -i 0 -lms 50 \
  >"$OUT/$NAME.mem" 2>/dev/null &
SAMPLER=$!
sleep 0.3
"$BIN" --recipe recipes/bench-1b.yaml \
  --set "run.dir=/tmp/memory_timeline/$NAME,train.steps=10,run.log_interval=1" "$@" >"$OUT/$NAME.log" 2>&1
RC=$?
sleep 0.5
kill "$SAMPLER" 2>/dev/null
wait "$SAMPLER" 2>/dev/null
echo "$NAME: exit $RC"
grep -E 'step=(1|2|10)/' "$OUT/$NAME.log" | sed -E 's/ tok\/s=.* mem=/ mem=/' | cut -c1-220
awk -F', ' '{ if ($2 + 0 > max) { max = $2 + 0; first = $1 } if ($2 + 0 == max) last = $1 }
  END { print "nvidia-smi memory.used peak " max " MiB, first at " first ", last at " last }' "$OUT/$NAME.mem"
exit $RC
