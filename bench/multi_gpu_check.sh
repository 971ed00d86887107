#!/usr/bin/env bash
# The checks only a machine with two or more GPUs can make, in one go (about 6 minutes on 8 GPUs):
# run it on the GPU machine from a copy of the repository with the binary of
# scripts/build-cuda.sh.
#
#   bench/multi_gpu_check.sh [PRETRAIN_BINARY[.xz]] [PART ...]
#
# PARTs (default: all, in this order):
#   selftest  pretrain selftest --device cuda: with two or more GPUs its rank-process layouts run
#             over NCCL (tp2 SP, dp2 ZeRO-1/2/3, pp2 1F1B and zbv, the cp2 ring, the ep2
#             all-to-all, and with four GPUs dp2 x tp2 and hybrid sharding) against one rank
#   comm      host microseconds per NCCL call: `pretrain bench-comm` on every GPU (our
#             non-blocking communicators: an all-reduce from the compute thread, one in place
#             from a communication thread, a ring hop) beside PyTorch's blocking communicators
#             (torch.distributed all-reduce, the same sizes), for 4 KiB and 4 MiB messages
#   train     20 steps of recipes/1b.yaml on every GPU (`--gpus N`: the planner's layout for
#             them), step 3 traced (run.trace_step: data-parallel overlap, tensor-parallel
#             exposure), with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ALLOC: the memory outside the
#             pool (device_outside_pool_mib) and NCCL's allocations against the plan's headroom
#             (context_gib + nccl_gib per communicator)
#
# Environment: PYTHON (default /opt/torch/.venv/bin/python, a venv with torch and the nvidia-*
# cu13 wheels), OUT (results; default runs/multi_gpu_check), PART_TIMEOUT (seconds per part, 240).
# Results: $OUT/check.log, $OUT/comm.jsonl, $OUT/train/ (metrics.jsonl, trace.json, the NCCL log).
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=./pretrain
if [ $# -gt 0 ] && [ -e "$1" ]; then BIN=$1; shift; fi
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(selftest comm train)
if [ "${BIN%.xz}" != "$BIN" ]; then
  xz -dkf "$BIN" && BIN=${BIN%.xz} && chmod +x "$BIN" || { echo "multi_gpu_check.sh: cannot unpack $BIN" >&2; exit 1; }
fi
BIN=$(realpath "$BIN")
PYTHON=${PYTHON:-/opt/torch/.venv/bin/python}
OUT=${OUT:-runs/multi_gpu_check}
PART_TIMEOUT=${PART_TIMEOUT:-240}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export NO_COLOR=1

SP=$("$PYTHON" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])') || {
  echo "multi_gpu_check.sh: no Python with site-packages at $PYTHON" >&2
  exit 1
}
export LD_LIBRARY_PATH=$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:$SP/nvidia/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

exec > >(tee -a "$OUT/check.log") 2>&1
echo "== multi_gpu_check $(date -u +%FT%TZ) binary $BIN"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
nvidia-smi topo -m || true
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
if [ "$GPUS" -lt 2 ]; then
  echo "multi_gpu_check.sh: $GPUS GPU(s): these checks need two or more (NCCL refuses two ranks on one device)" >&2
  exit 1
fi

FAILED=()
part() { # part NAME COMMAND...: runs COMMAND under the timeout, reports its status and time
  local name=$1
  shift
  echo
  echo "== $name: $*"
  local t0=$SECONDS
  timeout -k 10 "$PART_TIMEOUT" "$@"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ $rc = 0 ] || FAILED+=("$name (exit $rc)")
  return $rc
}

# The tiny recipe on GPUs, laid out for all of them (bench-comm uses only its world size and
# device).
COMM_SET="train.device=cuda,parallel.dp=$GPUS,train.global_batch=$((8 * GPUS)),train.micro_batch=8"

for p in "${PARTS[@]}"; do
  case $p in
    selftest)
      part selftest "$BIN" selftest --device cuda --json "$OUT/selftest.json"
      ;;
    comm)
      : >"$OUT/comm.jsonl"
      cat >"$OUT/allreduce_torch.py" <<'PY'
import json, os, sys, time
import torch, torch.distributed as dist
n, calls, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")  # blocking communicators, PyTorch's default
x = torch.ones(n, device="cuda")
for _ in range(20):
    dist.all_reduce(x)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(calls):
    dist.all_reduce(x)
host = (time.perf_counter() - t0) * 1e6 / calls
torch.cuda.synchronize()
done = (time.perf_counter() - t0) * 1e6 / calls
if rank == 0:
    line = json.dumps({"backend": "torch nccl (blocking)", "world": dist.get_world_size(),
                       "elements": n, "all_reduce_us": host, "all_reduce_done_us": done})
    print(line)
    open(out, "a").write(line + "\n")
dist.destroy_process_group()
PY
      for n in 1024 1048576; do
        part "comm-ours-$n" bash -c '"$0" bench-comm --recipe recipes/tiny.yaml --set "$1" \
          --nproc-per-node "$2" --calls 1000 --elements "$3" | tee -a "$4"' \
          "$BIN" "$COMM_SET" "$GPUS" "$n" "$OUT/comm.jsonl"
        part "comm-torch-$n" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" \
          "$OUT/allreduce_torch.py" "$n" 1000 "$OUT/comm.jsonl"
      done
      ;;
    train)
      rm -rf "$OUT/train"
      mkdir -p "$OUT/train"
      part train env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ALLOC \
        NCCL_DEBUG_FILE="$OUT/train/nccl.%h.%p.log" "$BIN" --recipe recipes/1b.yaml --gpus "$GPUS" \
        --set "run.dir=$OUT/train,train.steps=20,run.trace_step=3,checkpoint.interval=0,train.eval_interval=0,data.datasets=[{prefix: data/shakespeare/shakespeare}],data.tokenizer=data/shakespeare/tokenizer.json"
      "$BIN" plan --recipe "$OUT/train/recipe.yaml" --gpu "${GPU_PRESET:-h200}" | tee "$OUT/train/plan.txt"
      "$PYTHON" - "$OUT/train" <<'PY'
import glob, json, re, sys
d = sys.argv[1]
recs = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if l.strip()]
steps = [r for r in recs if "tokens_per_s" in r]
outside = max((r.get("device_outside_pool_mib") or 0) for r in steps) if steps else None
print(f"steps: {len(steps)}; rank 0's memory outside the pool at most {outside} MiB")
traced = [r for r in steps if r.get("bubble") is not None or r.get("sync_overlap") is not None]
for r in traced:
    print("traced step:", {k: r.get(k) for k in ("step", "bubble", "sync_overlap", "sync_exposed_s")})
alloc = 0
for f in glob.glob(f"{d}/nccl.*.log"):
    for line in open(f):
        m = re.search(r"(\d+) bytes", line)
        if "Alloc" in line and m:
            alloc += int(m.group(1))
print(f"NCCL allocations logged (all ranks): {alloc / 2**20:.0f} MiB")
PY
      ;;
    *)
      echo "multi_gpu_check.sh: unknown part '$p'" >&2
      FAILED+=("$p (unknown)")
      ;;
  esac
done

echo
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "multi_gpu_check: FAILED: ${FAILED[*]}"
  exit 1
fi
echo "multi_gpu_check: all parts passed"
