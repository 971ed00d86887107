#!/usr/bin/env bash
# Median training-step time of a recipe: runs STEPS + 2 steps (the first two are warm-up) with
# validation, checkpoints and tracing off, and prints the median `step_time_s` of the last STEPS
# steps from metrics.jsonl. Comparing two builds: run it with each binary, one after the other,
# on an otherwise idle machine.
#
# Usage: bench/step_time.sh [BIN] [RECIPE] [STEPS] [KEY=VALUE ...]
#   BIN     the pretrain binary (default: target/release/pretrain, built here)
#   RECIPE  default recipes/tiny-3d.yaml
#   STEPS   steps measured (default 20)
#   KEY=VALUE  extra recipe overrides
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/pretrain}
RECIPE=${2:-recipes/tiny-3d.yaml}
STEPS=${3:-20}
shift $(( $# < 3 ? $# : 3 ))
if [ "$BIN" = target/release/pretrain ]; then cargo build -q --release; fi
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
sets="train.steps=$((STEPS + 2)),train.eval_interval=0,checkpoint.interval=0,run.log_interval=1000,run.dir=$OUT"
for kv in "$@"; do sets="$sets,$kv"; done
# No trace step: the traced step gathers every rank's timings and would stand out.
"$BIN" --recipe "$RECIPE" --set "$sets" --set "run.trace_step=null" >"$OUT/log" 2>&1 || {
  cat "$OUT/log" >&2
  exit 1
}
python3 - "$OUT/metrics.jsonl" "$STEPS" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_time_s"' in l]
t = [r["step_time_s"] for r in rows][-int(sys.argv[2]):]
print(f"median {1000 * statistics.median(t):.1f} ms/step over {len(t)} steps "
      f"(min {1000 * min(t):.1f}, max {1000 * max(t):.1f}); final loss {rows[-1]['loss']!r}")
EOF
