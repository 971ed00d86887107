"""Split of GPU step time by kernel, from a timeline written by bench/cupti_trace.c.

    python bench/kernel_split.py cupti_trace.csv [--steps 3] [--json out.json]

Steps are found from the optimizer: each step ends with this project's `adamw` kernel launches
(PyTorch's fused AdamW kernels are recognised too), so the last `--steps` complete steps are
summarised. For them it prints the wall time per step, the time the GPU was busy (union of all
kernel, copy and memset intervals), the time per kernel category and the kernels that take the
most time, each as ms per step and share of the wall time.
"""
import argparse
import csv
import json
import re
import sys

CATEGORIES = [
    # cuDNN's fused-attention kernels (sdpa, fmha, matmul_dq) before the GEMMs, whose
    # architecture tags (sm90_) they share.
    ("attention", r"attn|flash|fmha|attention|sdpa|cudnn"),
    ("gemm (cuBLAS)", r"gemm|nvjet|xmma|cutlass|cublas|sm90_|sm80_|splitK"),
    ("nccl", r"nccl"),
    ("optimizer", r"adamw|sum_squares|multi_tensor|fused_adam"),
    ("rmsnorm", r"rms"),
    ("rope", r"rope|rotary"),
    ("swiglu", r"swiglu|silu"),
    ("cross-entropy", r"cross_entropy|xent|nll|log_softmax|softmax"),
    ("embedding", r"index_add|embedding|ia_u32|is_u32|gather|index_select"),
    ("copies/casts", r"^memcpy|copy|cast|ucopy|contiguous"),
    ("memset/fill", r"^memset|fill|zeros|const_set"),
    ("element-wise", r"affine|badd|bmul|bsub|bdiv|add|mul|elementwise|unary|binary|vectorized"),
    ("reductions", r"reduce|sum|max|min"),
]


def category(name):
    for cat, pat in CATEGORIES:
        if re.search(pat, name, re.IGNORECASE):
            return cat
    return "other"


def union_length(intervals):
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    args = ap.parse_args()

    rows = []
    with open(args.trace, newline="") as f:
        for r in csv.DictReader(f):
            try:
                rows.append((int(r["start_ns"]), int(r["end_ns"]), r["name"], r["kind"]))
            except (KeyError, ValueError, TypeError):  # a line cut off by a killed program
                continue
    if not rows:
        sys.exit(f"kernel_split.py: no records in {args.trace}")
    rows.sort()

    # Optimizer launches closer than 50 ms belong to one step's update.
    opt = [e for s, e, n, _ in rows if re.search(r"^adamw(_f32|_bf16)?$|fused_adam|multi_tensor_apply", n)]
    ends = []
    for e in opt:
        if ends and e - ends[-1] < 50_000_000:
            ends[-1] = e
        else:
            ends.append(e)
    if len(ends) < args.steps + 1:
        sys.exit(f"kernel_split.py: found {len(ends)} optimizer updates, need {args.steps + 1}")
    lo, hi = ends[-args.steps - 1], ends[-1]
    window = [(s, e, n, k) for s, e, n, k in rows if s >= lo and e <= hi]
    wall = (hi - lo) / args.steps
    busy = union_length([(s, e) for s, e, _, _ in window]) / args.steps

    per_name, per_cat, counts = {}, {}, {}
    for s, e, n, _ in window:
        per_name[n] = per_name.get(n, 0) + (e - s)
        counts[n] = counts.get(n, 0) + 1
        c = category(n)
        per_cat[c] = per_cat.get(c, 0) + (e - s)

    ms = lambda ns: ns / args.steps / 1e6
    print(f"{args.trace}: last {args.steps} steps, {len(window)} GPU records "
          f"({len(window) / args.steps:.0f} per step)")
    print(f"wall per step {wall / 1e6:.1f} ms, GPU busy {busy / 1e6:.1f} ms "
          f"({100 * busy / wall:.1f}%), idle {100 * (1 - busy / wall):.1f}%")
    print(f"\n{'category':24} {'ms/step':>9} {'% wall':>7}")
    for c, t in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        print(f"{c:24} {ms(t):>9.2f} {100 * t / args.steps / wall:>6.1f}%")
    print(f"\n{'kernel':70} {'calls/step':>10} {'ms/step':>9} {'% wall':>7}")
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[: args.top]
    for n, t in top:
        short = n if len(n) <= 70 else n[:67] + "..."
        print(f"{short:70} {counts[n] / args.steps:>10.0f} {ms(t):>9.2f} "
              f"{100 * t / args.steps / wall:>6.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "wall_ms": wall / 1e6, "busy_ms": busy / 1e6,
                       "records_per_step": len(window) / args.steps,
                       "categories_ms": {c: ms(t) for c, t in per_cat.items()},
                       "kernels": [{"name": n, "calls_per_step": counts[n] / args.steps,
                                    "ms": ms(t)} for n, t in top]}, f, indent=1)


if __name__ == "__main__":
    main()
