#!/usr/bin/env bash
# Training throughput of the ~1.1B model (recipes/bench-1b.yaml: one GPU, bf16, 4 micro-batches of
# 2 x 2048 tokens per step) with this project's CUDA build against PyTorch on the same GPU, model,
# batch and sequence length, in one run. Run on the GPU machine from a copy of the repository:
#
#   bench/gpu_step.sh [PRETRAIN_BINARY] [--set KEY=VALUE ...]
#
# PRETRAIN_BINARY defaults to ./pretrain (built by scripts/build-cuda.sh). Further arguments are
# recipe overrides given to both sides (e.g. --set train.micro_batch=4). Environment:
#   PYTHON=/opt/torch/.venv/bin/python  a Python with torch (CUDA) and the nvidia-* wheels
#   STEPS=30 WARMUP=5                   steps run by each side; the first WARMUP are not in the medians
#   PEAK_TFLOPS                         device peak for MFU (default: from the GPU name, see below)
#   TORCH_COMPILE=1                     also time PyTorch with torch.compile (adds compile time)
#   TORCH_MODES="eager compile"         the PyTorch modes to run (default: eager, plus compile
#                                       with TORCH_COMPILE=1)
#   TORCH_SET=KEY=VALUE[,KEY=VALUE]     recipe overrides for the PyTorch side only (e.g.
#                                       train.recompute=full where PyTorch must recompute to fit);
#                                       recorded in gpu_step.json as torch_overrides
#   ONLY=ours|torch                     run one side only (no ratio)
#   RECIPE=recipes/bench-1b.yaml
#   OUT=.                               gpu_step.json is written here; runs and logs go to
#   OUT_DIR=$OUT/gpu_step (or runs/gpu_step when OUT is unset)
# Prints the medians (tokens/s, TFLOP/s, MFU with causal attention counted once and, as most
# published tables count it, as if full; step time, peak GPU memory from nvidia-smi) of each side
# and the ratio ours / PyTorch, and writes them to $OUT/gpu_step.json. Exits non-zero, naming
# the side, when either side fails (the other side still runs, so its numbers are kept).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "gpu_step.sh: error: $*" >&2; exit 1; }

BIN=./pretrain
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then BIN=$1; shift; fi
EXTRA=("$@")
RECIPE=${RECIPE:-recipes/bench-1b.yaml}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-5}
ONLY=${ONLY:-}
PYTHON=${PYTHON:-/opt/torch/.venv/bin/python}
SUMMARY_DIR=${OUT:-.}
OUT_DIR=${OUT_DIR:-${OUT:-runs}/gpu_step}

case "$ONLY" in ""|ours|torch) ;; *) die "ONLY must be ours or torch, not '$ONLY'" ;; esac
for ((i = 0; i < ${#EXTRA[@]}; i += 2)); do
  [ "${EXTRA[i]}" = --set ] && [ $((i + 1)) -lt ${#EXTRA[@]} ] \
    || die "extra arguments must be --set KEY=VALUE pairs (got '${EXTRA[*]}')"
done
[[ "$STEPS" =~ ^[0-9]+$ && "$WARMUP" =~ ^[0-9]+$ && $WARMUP -lt $STEPS ]] \
  || die "need integers WARMUP < STEPS (got WARMUP=$WARMUP STEPS=$STEPS)"
[ -f "$RECIPE" ] || die "no recipe $RECIPE"
command -v "$PYTHON" >/dev/null || die "no Python at $PYTHON (set PYTHON=...)"
SP=$("$PYTHON" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])') \
  || die "$PYTHON could not report its site-packages"

# The CUDA 13 and NCCL libraries of the nvidia-* wheels (scripts/build-cuda.sh links against
# these sonames); cu12-layout directories too where present.
LIBS=
for d in "$SP/nvidia/cu13/lib" "$SP/nvidia/nccl/lib" "$SP"/nvidia/{cublas,cuda_runtime,cuda_nvrtc,curand}/lib; do
  [ -d "$d" ] && LIBS=${LIBS:+$LIBS:}$d
done
[ -n "$LIBS" ] || echo "gpu_step.sh: warning: no nvidia/*/lib directories under $SP" >&2
export LD_LIBRARY_PATH=${LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

command -v nvidia-smi >/dev/null || die "nvidia-smi not found: is this the GPU machine?"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0) || die "nvidia-smi cannot see a GPU"
echo "GPU: $GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv -i 0 || true

# Dense bf16 tensor-core peaks (NVIDIA data sheets, without sparsity). H200 has the H100's compute.
case "$GPU" in
  *H100*PCIe*) PEAK=756 ;;
  *H100*NVL* | *H200*NVL*) PEAK=835 ;;
  *H100* | *H200*) PEAK=989 ;;
  *) PEAK= ;;
esac
PEAK=${PEAK_TFLOPS:-$PEAK}
[ -n "$PEAK" ] || die "no known bf16 peak for '$GPU': set PEAK_TFLOPS"
echo "peak for MFU: $PEAK TFLOP/s (bf16 dense)"

if [ "$ONLY" != torch ]; then
  [ -x "$BIN" ] || die "no executable pretrain binary at $BIN (build it with scripts/build-cuda.sh and copy it here)"
  if command -v ldd >/dev/null && ldd "$BIN" 2>/dev/null | grep -q 'not found'; then
    ldd "$BIN" 2>/dev/null | grep 'not found' >&2
    die "$BIN misses shared libraries (LD_LIBRARY_PATH=$LD_LIBRARY_PATH); PYTHON must be a venv with the nvidia-*-cu13 wheels"
  fi
fi

mkdir -p "$OUT_DIR" "$SUMMARY_DIR"
export NO_COLOR=1

# GPU memory in use (MiB), sampled by nvidia-smi every 200 ms while a side runs; stop_mem sets
# MEM_PEAK to the largest sample.
SAMPLER=
start_mem() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 200 >"$1" 2>/dev/null & SAMPLER=$!; }
stop_mem() {
  if [ -n "$SAMPLER" ]; then kill "$SAMPLER" 2>/dev/null || true; wait "$SAMPLER" 2>/dev/null || true; SAMPLER=; fi
  MEM_PEAK=$(grep -E '^ *[0-9]+ *$' "$1" 2>/dev/null | sort -n | tail -1 | tr -d ' ' || true)
}
trap '[ -z "$SAMPLER" ] || kill "$SAMPLER" 2>/dev/null || true' EXIT

OURS_RC=skipped OURS_MEM=
if [ "$ONLY" != torch ]; then
  RUN_DIR=$OUT_DIR/ours
  rm -rf "$RUN_DIR"   # metrics.jsonl is appended to, so start from an empty run directory
  echo "== this project: $BIN --recipe $RECIPE (run dir $RUN_DIR)"
  start_mem "$OUT_DIR/ours.mem"
  set +e
  "$BIN" --recipe "$RECIPE" --set "run.dir=$RUN_DIR" --set "run.peak_tflops=$PEAK" \
    --set "train.steps=$STEPS" --set checkpoint.interval=0 --set train.eval_interval=0 ${EXTRA[@]+"${EXTRA[@]}"} \
    2>&1 | tee "$OUT_DIR/ours.log"
  OURS_RC=${PIPESTATUS[0]}
  set -e
  stop_mem "$OUT_DIR/ours.mem"
  OURS_MEM=$MEM_PEAK
  [ "$OURS_RC" = 0 ] || echo "gpu_step.sh: error: pretrain failed with exit status $OURS_RC (log: $OUT_DIR/ours.log)" >&2
fi

if [ -n "${TORCH_MODES:-}" ]; then
  read -ra TORCH_MODES <<<"$TORCH_MODES"
  for mode in "${TORCH_MODES[@]}"; do
    case "$mode" in eager|compile) ;; *) die "TORCH_MODES: '$mode' is neither eager nor compile" ;; esac
  done
else
  TORCH_MODES=(eager)
  [ "${TORCH_COMPILE:-0}" = 0 ] || TORCH_MODES+=(compile)
fi
TORCH_EXTRA=()
[ -z "${TORCH_SET:-}" ] || TORCH_EXTRA=(--set "$TORCH_SET")
export TORCH_SET=${TORCH_SET:-}
declare -A TORCH_RC TORCH_MEM
if [ "$ONLY" != ours ]; then
  for mode in "${TORCH_MODES[@]}"; do
    flag=()
    [ "$mode" = compile ] && flag=(--compile)
    echo "== PyTorch ($mode): bench/torch_llama.py $RECIPE $STEPS --device cuda --dtype bf16 ${flag[*]-} ${TORCH_EXTRA[*]-}"
    start_mem "$OUT_DIR/torch_$mode.mem"
    set +e
    "$PYTHON" bench/torch_llama.py "$RECIPE" "$STEPS" --device cuda --dtype bf16 --warmup "$WARMUP" \
      --peak-tflops "$PEAK" ${flag[@]+"${flag[@]}"} ${EXTRA[@]+"${EXTRA[@]}"} ${TORCH_EXTRA[@]+"${TORCH_EXTRA[@]}"} \
      >"$OUT_DIR/torch_$mode.json" 2> >(tee "$OUT_DIR/torch_$mode.log" >&2)
    TORCH_RC[$mode]=$?
    set -e
    stop_mem "$OUT_DIR/torch_$mode.mem"
    TORCH_MEM[$mode]=$MEM_PEAK
    [ "${TORCH_RC[$mode]}" = 0 ] \
      || echo "gpu_step.sh: error: PyTorch ($mode) failed with exit status ${TORCH_RC[$mode]} (log: $OUT_DIR/torch_$mode.log)" >&2
  done
fi
sleep 0.5   # let the tee of the last PyTorch log finish

TORCH_ARGS=()
if [ "$ONLY" != ours ]; then
  for mode in "${TORCH_MODES[@]}"; do
    TORCH_ARGS+=("$mode=${TORCH_RC[$mode]}=${TORCH_MEM[$mode]}=$OUT_DIR/torch_$mode.json")
  done
fi
set +e
"$PYTHON" - "$SUMMARY_DIR/gpu_step.json" "$GPU" "$PEAK" "$RECIPE" "$STEPS" "$WARMUP" \
  "$OURS_RC" "$OURS_MEM" "$OUT_DIR/ours/metrics.jsonl" ${TORCH_ARGS[@]+"${TORCH_ARGS[@]}"} <<'PY'
import json, os, statistics, sys

out, gpu, peak, recipe, steps, warmup, ours_rc, ours_mem, ours_metrics = sys.argv[1:10]
peak, steps, warmup = float(peak), int(steps), int(warmup)
errors = []


def mem(v):
    return float(v) if v else None


def ours():
    if ours_rc == "skipped":
        return None
    if ours_rc != "0":
        errors.append(f"this project: pretrain exited with status {ours_rc}")
        return {"error": f"exit status {ours_rc}"}
    try:
        recs = [json.loads(l) for l in open(ours_metrics) if l.strip()]
    except OSError as e:
        errors.append(f"this project: cannot read {ours_metrics}: {e}")
        return {"error": str(e)}
    recs = [r for r in recs if "tokens_per_s" in r]
    if len(recs) != steps or [r["step"] for r in recs] != list(range(1, steps + 1)):
        errors.append(f"this project: {ours_metrics} has {len(recs)} step records, expected steps 1..{steps}")
        return {"error": "incomplete metrics.jsonl"}
    timed = recs[warmup:]
    med = lambda k: statistics.median(r[k] for r in timed)
    return {"impl": "pretrain", "tokens_per_s": med("tokens_per_s"), "tflops": med("tflops"),
            "mfu": med("mfu") if timed[0].get("mfu") is not None else None,
            "step_ms": med("step_time_s") * 1e3, "last_loss": recs[-1]["loss"],
            "flops_per_token": med("tflops") * 1e12 / med("tokens_per_s"),
            "peak_gpu_mem_mib": mem(ours_mem), "metrics": ours_metrics,
            # What the memory pool held at its largest; nvidia-smi's peak less this is the memory
            # outside the pool (context, kernels, library workspaces): the planner's context_gib.
            "pool_mib": max((r.get("device_pool_mib") or 0) for r in recs) or None,
            # The same, measured by the process itself (the driver's used bytes less the pool's).
            "outside_pool_mib": max((r.get("device_outside_pool_mib") or 0) for r in recs) or None,
            "per_step": [{k: r[k] for k in ("step", "loss", "step_time_s", "tokens_per_s", "tflops", "mfu")}
                         for r in recs]}


def torch_side(spec):
    mode, rc, m, path = spec.split("=", 3)
    if rc != "0":
        errors.append(f"PyTorch ({mode}): bench/torch_llama.py exited with status {rc}")
        return mode, {"error": f"exit status {rc}"}
    try:
        r = json.loads(open(path).read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError) as e:
        errors.append(f"PyTorch ({mode}): no JSON result in {path}: {e}")
        return mode, {"error": str(e)}
    r["peak_gpu_mem_mib"] = mem(m)
    return mode, r


o = ours()
t = dict(torch_side(s) for s in sys.argv[10:])
ok = lambda r: r is not None and "error" not in r
fpt = next((r["flops_per_token"] for r in t.values() if ok(r)), None)
if ok(o) and fpt and abs(o["flops_per_token"] / fpt - 1) > 1e-6:
    errors.append(f"FLOPs per token differ: pretrain {o['flops_per_token']:.6g}, torch_llama.py {fpt:.6g} "
                  "(different model config, or the FLOP formula port is out of date)")
ratios = {m: o["tokens_per_s"] / r["tokens_per_s"] for m, r in t.items() if ok(o) and ok(r)}
first = next((r for r in t.values() if ok(r)), {})
# MFU in the count most published tables use (causal attention counted as if full, 12 L s h per
# token) beside ours (causal attention counted once, 6 L s h), both from PyTorch's numbers.
full = first.get("flops_per_token_full_attention")
for r in [o] + list(t.values()):
    if ok(r) and full and fpt and r.get("mfu") is not None:
        r["mfu_full_attention"] = r["mfu"] * full / fpt
summary = {"gpu": gpu, "peak_tflops": peak, "recipe": recipe, "steps": steps, "warmup": warmup,
           "median_of_steps": [warmup + 1, steps], "tokens_per_step": first.get("tokens_per_step"),
           "params": first.get("params"), "flops_per_token": fpt, "ours": o,
           "torch": t, "torch_overrides": os.environ.get("TORCH_SET") or None,
           "ratio_ours_over_torch_tokens_per_s": ratios, "errors": errors, "ok": not errors}
with open(out, "w") as f:
    json.dump(summary, f, indent=1)

fmt = lambda v, p: f"{'-':>{p[1:].split('.')[0]}}" if v is None else f"{v:{p}}"
print(f"\nGPU benchmark on {gpu}, {recipe}: "
      + (f"{first['params']:,} parameters, {first['grad_accum']} x {first['micro_batch']} x "
         f"{first['seq_len']} tokens per step, " if first else "")
      + f"median of steps {warmup + 1}-{steps}, MFU against {peak:g} TFLOP/s")
print(f"{'':34} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7} {'MFU full':>9} {'step ms':>9} "
      f"{'GPU mem MiB':>12}")
rows = ([("this project", o)] if o is not None else []) + \
       [(f"PyTorch {m} ({r.get('version', '?')})", r) for m, r in t.items()]
for name, r in rows:
    if not ok(r):
        print(f"{name:34} FAILED: {r['error']}")
        continue
    mfu = None if r.get("mfu") is None else 100 * r["mfu"]
    mfu_full = None if r.get("mfu_full_attention") is None else 100 * r["mfu_full_attention"]
    print(f"{name:34} {r['tokens_per_s']:>10.0f} {r['tflops']:>8.1f} {fmt(mfu, '>6.1f')}% "
          f"{fmt(mfu_full, '>8.1f')}% {r['step_ms']:>9.1f} {fmt(r.get('peak_gpu_mem_mib'), '>12.0f')}")
for m, x in ratios.items():
    print(f"ratio ours / PyTorch {m} (tokens/s): {x:.3f}x")
if os.environ.get("TORCH_SET"):
    print(f"PyTorch ran with {os.environ['TORCH_SET']}" + (" (this project without)" if o else ""))
if ok(o) and o.get("pool_mib") and o.get("peak_gpu_mem_mib"):
    print(f"this project's memory outside its pool: {o['peak_gpu_mem_mib'] - o['pool_mib']:.0f} MiB "
          f"(nvidia-smi peak {o['peak_gpu_mem_mib']:.0f} less the pool's {o['pool_mib']:.0f}; "
          "`pretrain plan --context-gib`)"
          + (f"; {o['outside_pool_mib']:.0f} MiB as the process measures it (device_outside_pool_mib)"
             if o.get("outside_pool_mib") else ""))
print(f"written: {out}")
for e in errors:
    print(f"gpu_step.sh: error: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PY
RC=$?
set -e
[ "$RC" = 0 ] || die "benchmark failed (see the errors above; logs in $OUT_DIR)"
