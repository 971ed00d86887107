"""PyTorch's scaled_dot_product_attention on one shape, forward and backward, per SDPA backend
(flash, cudnn): the peer of `pretrain bench-attention` in bench/attention_gpu.sh, with the same
inputs (q [b, s, hq, d], k and v [b, sk, hkv, d], bf16, viewed as [b, h, s, d]), the same FLOP
count (forward 4·b·hq·s·sk·d, halved when causal; backward 2.5 times that) and the same timing
(3 warm-up calls, then the mean of --iters calls between device synchronisations).

    python bench/attention_sdpa.py --batch 2 --seq 2048 --heads 32 --kv-heads 4 --head-dim 64
"""
import argparse
import json
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--keys", type=int)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--unmasked", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--backend", default="flash,cudnn")
    p.add_argument("--json")
    a = p.parse_args()
    keys = a.keys or a.seq
    if keys != a.seq and not a.unmasked:
        sys.exit("--keys differs from --seq: add --unmasked")
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g)

    # [b, s, h, d] storage viewed as [b, h, s, d], as the model lays activations out.
    q = randn(a.batch, a.seq, a.heads, a.head_dim).transpose(1, 2).requires_grad_()
    k = randn(a.batch, keys, a.kv_heads, a.head_dim).transpose(1, 2).requires_grad_()
    v = randn(a.batch, keys, a.kv_heads, a.head_dim).transpose(1, 2).requires_grad_()
    dout = randn(a.batch, a.seq, a.heads, a.head_dim).transpose(1, 2)
    flops = 4.0 * a.batch * a.heads * a.seq * keys * a.head_dim * (1.0 if a.unmasked else 0.5)
    shape = (f"b{a.batch} s{a.seq} sk{keys} h{a.heads}/{a.kv_heads} d{a.head_dim} "
             f"{'unmasked' if a.unmasked else 'causal'} bf16")
    results = []
    for name in a.backend.split(","):
        try:
            with sdpa_kernel([BACKENDS[name]]):
                def fwd():
                    return F.scaled_dot_product_attention(
                        q, k, v, is_causal=not a.unmasked, enable_gqa=a.heads != a.kv_heads)

                def timed(f):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(a.iters):
                        f()
                    torch.cuda.synchronize()
                    return (time.perf_counter() - t0) * 1e3 / a.iters

                for _ in range(3):
                    fwd().backward(dout)
                with torch.no_grad():
                    fwd_ms = timed(fwd)
                out = fwd()
                bwd_ms = timed(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        except Exception as e:  # a backend that cannot take the shape is reported, not fatal
            print(f"{shape} torch-{name}: unavailable ({str(e).splitlines()[0]})")
            continue
        tf = lambda f, ms: f / (ms * 1e-3) / 1e12
        r = dict(backend=f"torch-{name}", shape=shape, fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                 fwd_tflops=tf(flops, fwd_ms), bwd_tflops=tf(2.5 * flops, bwd_ms),
                 tflops=tf(3.5 * flops, fwd_ms + bwd_ms))
        print(f"{shape} {r['backend']:>12}: forward {fwd_ms:8.3f} ms {r['fwd_tflops']:7.1f} TFLOP/s, "
              f"backward {bwd_ms:8.3f} ms {r['bwd_tflops']:7.1f} TFLOP/s, both {r['tflops']:7.1f} TFLOP/s")
        results.append(r)
    if a.json:
        json.dump(results, open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
