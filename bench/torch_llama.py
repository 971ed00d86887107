"""PyTorch reference for the step benchmarks: the same Llama (RMSNorm, rotate-half RoPE,
grouped-query attention through SDPA, SwiGLU, tied or untied embeddings; with
`model.num_local_experts`, Mixtral-style MoE layers as transformers computes them eagerly), the
same batch shape and the same synthetic token stream as the benches (benches/common/mod.rs).
Prints one JSON line on stdout.

CPU (bench/cpu_step.sh), f32 eager, forward and full step timed separately, median of STEPS steps
after 2 warm-up steps:

    python bench/torch_llama.py recipes/tiny.yaml [STEPS]

GPU (bench/gpu_step.sh): STEPS full training steps (default: the recipe's train.steps), each timed
between torch.cuda.synchronize() calls; medians over the steps after the first --warmup:

    python bench/torch_llama.py recipes/bench-1b.yaml [STEPS] --device cuda --dtype bf16 \
        [--warmup 5] [--peak-tflops 989] [--compile] [--sdpa flash|auto] [--set train.micro_batch=4]

The recipe is read like `pretrain` reads it: `inherit:` chains are followed and `--set a.b=value`
overrides applied, so the model, batch and sequence length are those of the run it is compared
with. Throughput in TFLOP/s uses `LlamaConfig::flops_per_token` (crates/model/src/config.rs),
ported exactly below, so both sides count the same FLOPs per token.

Precision on GPU (`--dtype bf16`): torch.autocast(bfloat16) over fp32 parameters, with fused
AdamW on the fp32 parameters and gradients. This is PyTorch's standard mixed-precision recipe and
keeps what this project keeps in fp32 (master weights, AdamW moments, gradient accumulation), so
both sides apply the same fp32 update with matmuls and attention in bf16. Pure bf16 parameters
would drop the fp32 master weights (and round every update to bf16), a cheaper and numerically
different optimizer than ours. The difference that remains: under autocast the residual stream
and the norms stay in fp32 (the matmul inputs are cast to bf16), whereas this project keeps
activations in bf16. The global gradient norm is computed and clipped every step
(train.grad_clip) as in `pretrain`.

FP8 on GPU: a recipe with `train.fp8.scaling: tensorwise` (e.g. `--set
train.fp8.scaling=tensorwise`, given to both sides by bench/gpu_step.sh) runs torchao's float8
training on the blocks' linears of the layers `pretrain` runs in FP8; torchao must be installed.
"""
import argparse
import contextlib
import json
import math
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint  # noqa: F401  (the submodule, for Llama.forward's recompute)
import yaml

# Set for GPU runs: RMSNorm through F.rms_norm (one kernel where PyTorch has a fused one) instead of
# the explicit formula, which the CPU benchmark keeps so its numbers stay comparable over time.
FUSED_NORM = False


def rms_norm(x, w, eps):
    if FUSED_NORM:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def moe_settings(c):
    """The mixture-of-experts settings as LlamaConfig::moe resolves them, or None (dense)."""
    if c.get("num_local_experts") is None:
        return None
    return {"experts": c["num_local_experts"], "k": c.get("num_experts_per_tok", 2),
            "aux": c.get("router_aux_loss_coef", 0.02), "z": c.get("router_z_loss_coef", 0.0),
            "norm_topk": c.get("norm_topk_prob", True),
            "size": c.get("moe_intermediate_size") or c["intermediate_size"],
            "dense": set(c.get("mlp_only_layers", []))}


class Moe(torch.nn.Module):
    """A Mixtral-style sparse MLP as transformers' eager MixtralSparseMoeBlock computes it: an f32
    router, softmax, top-k (renormalised), each expert's SwiGLU over the tokens routed to it, and
    the load-balancing (Switch/Mixtral) and z losses our layer adds to the objective."""

    def __init__(self, h, m):
        super().__init__()
        self.m = m
        e, f = m["experts"], m["size"]
        self.router = torch.nn.Linear(h, e, bias=False)
        self.gate = torch.nn.ModuleList(torch.nn.Linear(h, f, bias=False) for _ in range(e))
        self.up = torch.nn.ModuleList(torch.nn.Linear(h, f, bias=False) for _ in range(e))
        self.down = torch.nn.ModuleList(torch.nn.Linear(f, h, bias=False) for _ in range(e))
        self.aux = None

    def forward(self, x):
        shape, m = x.shape, self.m
        x = x.reshape(-1, shape[-1])  # [n, h]
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())  # [n, E] in f32
        probs = logits.softmax(-1)
        w, idx = probs.topk(m["k"], dim=-1)  # [n, k]
        if m["norm_topk"]:
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(m["experts"]):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            ye = self.down[e](F.silu(self.gate[e](xe)) * self.up[e](xe))
            out.index_add_(0, tok, (ye * w[tok, slot, None]).to(out.dtype))
        n, experts = x.shape[0], m["experts"]
        share = torch.zeros(experts, device=x.device).index_add_(
            0, idx.reshape(-1), torch.ones(idx.numel(), device=x.device)) / (n * m["k"])
        balance = experts * (share * probs.mean(0)).sum() * m["k"]
        z = logits.logsumexp(-1).pow(2).mean()
        self.aux = m["aux"] * balance + m["z"] * z
        return out.reshape(shape)


class Block(torch.nn.Module):
    def __init__(self, c, layer=0):
        super().__init__()
        h, f = c["hidden_size"], c["intermediate_size"]
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.d = h // self.nh
        self.eps = c.get("rms_norm_eps", 1e-5)
        self.ln1 = torch.nn.Parameter(torch.ones(h))
        self.ln2 = torch.nn.Parameter(torch.ones(h))
        self.q = torch.nn.Linear(h, h, bias=False)
        self.k = torch.nn.Linear(h, self.nkv * self.d, bias=False)
        self.v = torch.nn.Linear(h, self.nkv * self.d, bias=False)
        self.o = torch.nn.Linear(h, h, bias=False)
        m = moe_settings(c)
        self.moe = Moe(h, m) if m is not None and layer not in m["dense"] else None
        if self.moe is None:
            self.gate = torch.nn.Linear(h, f, bias=False)
            self.up = torch.nn.Linear(h, f, bias=False)
            self.down = torch.nn.Linear(f, h, bias=False)

    def norm(self, x, w):
        return rms_norm(x, w, self.eps)

    @staticmethod
    def rope(x, cos, sin):
        # The tables are fp32; cast them to the activations' dtype so that under autocast q and k
        # stay bf16 (fp32 would keep SDPA off the flash kernel). A no-op for f32 on CPU.
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.norm(x, self.ln1)
        q = self.q(h).view(b, s, self.nh, self.d).transpose(1, 2)
        k = self.k(h).view(b, s, self.nkv, self.d).transpose(1, 2)
        v = self.v(h).view(b, s, self.nkv, self.d).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.norm(x, self.ln2)
        if self.moe is not None:
            return x + self.moe(h)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        v, h = c["vocab_size"], c["hidden_size"]
        self.embed = torch.nn.Embedding(v, h)
        self.blocks = torch.nn.ModuleList(Block(c, i) for i in range(c["num_hidden_layers"]))
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.head = torch.nn.Linear(h, v, bias=False)
        if c.get("tie_word_embeddings", False):
            self.head.weight = self.embed.weight
        d = h // c["num_attention_heads"]
        inv = c.get("rope_theta", 10000.0) ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.outer(torch.arange(c["max_position_embeddings"], dtype=torch.float64), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        self.eps = c.get("rms_norm_eps", 1e-5)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)

    # Recompute each block's activations in its backward (torch.utils.checkpoint), as the
    # recipe's `train.recompute: full` does on our side; set by cuda_bench.
    recompute = False

    def forward(self, tokens, labels):
        s = tokens.shape[1]
        x = self.embed(tokens)
        for blk in self.blocks:
            if self.recompute and self.training:
                x = torch.utils.checkpoint.checkpoint(blk, x, self.cos[:s], self.sin[:s],
                                                      use_reentrant=False)
            else:
                x = blk(x, self.cos[:s], self.sin[:s])
        x = rms_norm(x, self.norm, self.eps)
        logits = self.head(x).float()
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        # The MoE layers' balancing and z losses (none in a dense model).
        for blk in self.blocks:
            if blk.moe is not None and blk.moe.aux is not None:
                loss = loss + blk.moe.aux
        return loss


# ---- recipes: the same reading as src/recipe/load.rs ----------------------------------------------

def _merge(base, over):
    """Deep merge as in load.rs: mappings merge key by key, anything else replaces."""
    if isinstance(base, dict) and isinstance(over, dict):
        for k, v in over.items():
            base[k] = _merge(base[k], v) if k in base else v
        return base
    return over


def _read_with_inherit(path, chain):
    real = os.path.realpath(path)
    if real in chain:
        raise SystemExit(f"{path}: inherit cycle through {path}")
    chain.append(real)
    with open(path) as f:
        value = yaml.safe_load(f)
    if not isinstance(value, dict):
        raise SystemExit(f"{path}: the top level must be a mapping")
    base = value.pop("inherit", None)
    if base is None:
        return value
    if not isinstance(base, str):
        raise SystemExit(f"{path}: inherit: must be a file path")
    merged = _read_with_inherit(os.path.join(os.path.dirname(path) or ".", base), chain)
    return _merge(merged, value)


def _split_overrides(arg):
    """`a.b=1,c.d=x,y` -> [(a.b, 1), (c.d, "x,y")], as load.rs's split_overrides."""
    out = []
    for piece in arg.split(","):
        k = piece.split("=", 1)[0] if "=" in piece else None
        if k and all(ch.isascii() and (ch.isalnum() or ch in "_.") for ch in k):
            out.append([k, piece.split("=", 1)[1]])
        elif out:
            out[-1][1] += "," + piece
        else:
            raise SystemExit(f"--set {arg}: expected key.path=value (e.g. train.steps=100)")
    return out


def load_recipe(path, overrides=()):
    recipe = _read_with_inherit(path, [])
    for arg in overrides:
        for key, raw in _split_overrides(arg):
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                value = raw
            node, parts = recipe, key.split(".")
            for i, part in enumerate(parts[:-1]):
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise SystemExit(f"--set {arg}: `{'.'.join(parts[:i + 1])}` is not a section")
            node[parts[-1]] = value
    m = recipe.get("model", {})
    if m.get("rope_scaling") or m.get("head_dim", m["hidden_size"] // m["num_attention_heads"]) \
            != m["hidden_size"] // m["num_attention_heads"]:
        raise SystemExit("this reference implements plain RoPE and head_dim = hidden_size / "
                         "num_attention_heads; the recipe sets model.rope_scaling or model.head_dim")
    return recipe


# ---- FLOPs: LlamaConfig::num_params and ::flops_per_token of crates/model/src/config.rs ------------

def num_params(c, active=False):
    """LlamaConfig::count_params: every expert counted, or (`active`) the k a token uses."""
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    layers = c["num_hidden_layers"]
    attention = 2 * h + h * h * 2 + 2 * h * kv
    m = moe_settings(c)
    if m is None:
        mlp = layers * 3 * h * f
    else:
        moe_layers = sum(1 for i in range(layers) if i not in m["dense"])
        experts = m["k"] if active else m["experts"]
        mlp = moe_layers * (m["experts"] * h + experts * 3 * h * m["size"]) \
            + (layers - moe_layers) * 3 * h * f
    head = 0 if c.get("tie_word_embeddings", False) else v * h
    return v * h + layers * attention + mlp + h + head


def flops_per_token(c, seq_len):
    """6 N + 6 L s h, N = the matrices a token uses (embedding lookup excluded, output projection
    included, k experts and the router of a MoE layer)."""
    h, v, layers = float(c["hidden_size"]), float(c["vocab_size"]), c["num_hidden_layers"]
    matrices = (float(num_params(c, active=True))
                - v * h * (0.0 if c.get("tie_word_embeddings", False) else 1.0)
                - (2 * layers + 1) * h)
    attention = 6.0 * layers * float(seq_len) * h
    return 6.0 * matrices + attention


# ---- shared setup ---------------------------------------------------------------------------------

def synthetic_batches(vocab, micro, b, s):
    """The benches' token stream (benches/common/mod.rs): x <- x * 6364136223846793005 + 1442695040888963407 mod
    2^64 from 42, token = (x >> 33) mod vocab; `micro` micro-batches of b rows of s + 1 tokens."""
    x, mask64 = 42, (1 << 64) - 1

    def nxt():
        nonlocal x
        x = (x * 6364136223846793005 + 1442695040888963407) & mask64
        return (x >> 33) % vocab

    batches = []
    for _ in range(micro):
        seqs = torch.tensor([[nxt() for _ in range(s + 1)] for _ in range(b)])
        batches.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()))
    return batches


def shapes(recipe):
    c, t = recipe["model"], recipe["train"]
    b, s = t["micro_batch"], t["seq_len"]
    micro = t["global_batch"] // (t["micro_batch"] * recipe.get("parallel", {}).get("dp", 1))
    return c, t, b, s, micro


# ---- CPU: the benchmark bench/cpu_step.sh has always run ------------------------------------------

def cpu_bench(recipe, steps):
    c, t, b, s, micro = shapes(recipe)
    o = recipe["optimizer"]
    batches = synthetic_batches(c["vocab_size"], micro, b, s)
    torch.manual_seed(0)
    model = Llama(c)
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(o.get("beta1", 0.9), o.get("beta2", 0.95)),
                            eps=o.get("eps", 1e-8), weight_decay=o.get("weight_decay", 0.1))
    fwd, step = [], []
    loss = 0.0
    for i in range(steps + 2):
        t0 = time.perf_counter()
        for tok, lab in batches:
            float(model(tok, lab))
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = 0.0
        for tok, lab in batches:
            l = model(tok, lab) / micro
            l.backward()
            loss += float(l)
        opt.step()
        t2 = time.perf_counter()
        if i >= 2:
            fwd.append((t1 - t0) * 1e3)
            step.append((t2 - t1) * 1e3)
    print(json.dumps({"impl": "torch", "version": torch.__version__, "threads": torch.get_num_threads(),
                      "tokens_per_step": micro * b * s, "fwd_ms": round(statistics.median(fwd), 2),
                      "step_ms": round(statistics.median(step), 2), "last_loss": round(loss, 4)}))


# ---- GPU: full training steps in bf16 mixed precision ---------------------------------------------

def cuda_bench(recipe, args):
    global FUSED_NORM
    c, t, b, s, micro = shapes(recipe)
    o = recipe["optimizer"]
    steps = args.steps if args.steps is not None else int(t["steps"])
    if not 0 <= args.warmup < steps:
        raise SystemExit(f"--warmup ({args.warmup}) must be below the number of steps ({steps})")
    peak = args.peak_tflops
    if peak is None and recipe.get("run", {}).get("peak_tflops") is not None:
        peak = float(recipe["run"]["peak_tflops"])
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False "
                         f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    dev = torch.device("cuda")
    torch.cuda.init()
    FUSED_NORM = hasattr(F, "rms_norm")
    bf16 = args.dtype == "bf16"
    clip = float(t.get("grad_clip", 1.0))
    tokens = micro * b * s
    fpt = flops_per_token(c, s)

    batches = [(tok.to(dev), lab.to(dev)) for tok, lab in synthetic_batches(c["vocab_size"], micro, b, s)]
    torch.manual_seed(0)
    with dev:  # build and initialise the parameters on the GPU
        model = Llama(c)
    # Activation checkpointing exactly where our side recomputes whole blocks.
    model.recompute = t.get("recompute", "none") == "full"
    fp8 = float8(model, t, c["num_hidden_layers"])
    params = [p for p in model.parameters()]
    step_model = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(params, lr=float(o["lr"]),
                            betas=(float(o.get("beta1", 0.9)), float(o.get("beta2", 0.95))),
                            eps=float(o.get("eps", 1e-8)), weight_decay=float(o.get("weight_decay", 0.1)),
                            fused=True)
    amp = (lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    if args.sdpa == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        attn = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731  (fails rather than falls back)
    else:
        attn = contextlib.nullcontext

    name = torch.cuda.get_device_name(dev)
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {name}: {num_params(c):,} parameters, "
          f"{micro} x {b} x {s} tokens per step, {args.dtype}{' + torch.compile' if args.compile else ''}{fp8}, "
          f"sdpa {args.sdpa}, {fpt / 1e9:.3f} GFLOP/token", file=sys.stderr, flush=True)
    records = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = torch.zeros((), device=dev)
        with attn():
            for tok, lab in batches:
                with amp():
                    loss = step_model(tok, lab) / micro
                loss.backward()
                total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v, norm_v = float(total), float(grad_norm)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        tflops = tokens * fpt / secs / 1e12
        rec = {"step": i + 1, "loss": loss_v, "grad_norm": norm_v, "step_time_s": secs,
               "tokens_per_s": tokens / secs, "tflops": tflops, "mfu": tflops / peak if peak else None}
        records.append(rec)
        mfu = f"{100 * rec['mfu']:.1f}%" if peak else "n/a"
        print(f"step={i + 1}/{steps} loss={loss_v:.4f} grad_norm={norm_v:.3f} ms={secs * 1e3:.1f} "
              f"tok/s={rec['tokens_per_s']:.0f} tflops={tflops:.1f} mfu={mfu}", file=sys.stderr, flush=True)
        if not math.isfinite(loss_v):
            raise SystemExit(f"step {i + 1}: loss is {loss_v}")

    timed = records[args.warmup:]
    med = lambda k: statistics.median(r[k] for r in timed)  # noqa: E731
    print(json.dumps({
        "impl": "torch", "version": torch.__version__, "cuda": torch.version.cuda, "device": name,
        "dtype": args.dtype, "precision": "autocast bf16, fp32 params + fused AdamW" if bf16 else "f32",
        "compile": args.compile, "sdpa": args.sdpa, "params": num_params(c),
        "recompute": "full" if model.recompute else "none",
        "flops_per_token": fpt, "tokens_per_step": tokens,
        # The count most published tables use: causal attention counted as if full (12 L s h).
        "flops_per_token_full_attention": fpt + 6.0 * c["num_hidden_layers"] * s * c["hidden_size"], "micro_batch": b, "grad_accum": micro,
        "seq_len": s, "steps": steps, "warmup": args.warmup, "peak_tflops": peak,
        "step_ms": round(med("step_time_s") * 1e3, 2), "tokens_per_s": round(med("tokens_per_s"), 1),
        "tflops": round(med("tflops"), 2), "mfu": round(med("mfu"), 4) if peak else None,
        "last_loss": round(records[-1]["loss"], 4),
        "max_mem_allocated_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2),
        "max_mem_reserved_gib": round(torch.cuda.max_memory_reserved(dev) / 2**30, 2),
        "per_step": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in records],
    }))


def float8(model, t, layers):
    """The recipe's `train.fp8` on the PyTorch side: torchao's float8 training (dynamic
    tensorwise scaling, its default) on the blocks' seven linears of the layers `pretrain` runs in
    FP8 (all but `bf16_first` and `bf16_last`). Returns the description for the log line."""
    f = t.get("fp8") or {}
    scaling = f.get("scaling", "none")
    if scaling == "none":
        return ""
    if scaling != "tensorwise":
        raise SystemExit(f"train.fp8.scaling: {scaling} has no torchao peer here (tensorwise only)")
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise SystemExit(f"train.fp8 on the PyTorch side needs torchao (pip install torchao): {e}")
    first, last = int(f.get("bf16_first", 1)), int(f.get("bf16_last", 1))
    linear = re.compile(r"blocks\.(\d+)\.(q|k|v|o|gate|up|down)$")

    def chosen(_module, fqn):
        m = linear.match(fqn)
        return m is not None and first <= int(m.group(1)) < layers - last

    convert_to_float8_training(model, module_filter_fn=chosen)
    return f", torchao float8 tensorwise on layers {first}..{layers - last}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("steps", nargs="?", type=int, default=None,
                   help="CPU: timed steps after 2 warm-up steps (default 10); "
                        "cuda: all steps, warm-up included (default: train.steps)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["f32", "bf16"], default=None,
                   help="cuda default bf16 (autocast over fp32 parameters); CPU: f32 only")
    p.add_argument("--warmup", type=int, default=5, help="cuda: leading steps left out of the medians")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak for MFU (default: the recipe's run.peak_tflops)")
    p.add_argument("--compile", action="store_true", help="cuda: torch.compile the model")
    p.add_argument("--sdpa", choices=["flash", "auto"], default="flash",
                   help="cuda: force the flash-attention SDPA backend (an error if it cannot run, e.g. "
                        "with --dtype f32) or let PyTorch choose")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override as for pretrain, e.g. --set train.micro_batch=4; repeatable")
    args = p.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    if args.device == "cpu":
        if args.dtype not in (None, "f32") or args.compile:
            raise SystemExit("--device cpu runs the f32 eager benchmark only (no --dtype bf16, no --compile)")
        cpu_bench(recipe, args.steps if args.steps is not None else 10)
    else:
        args.dtype = args.dtype or "bf16"
        cuda_bench(recipe, args)


if __name__ == "__main__":
    main()
