"""PyTorch eager reference for the CPU step benchmark: the same Llama (RMSNorm, rotate-half RoPE,
grouped-query attention through SDPA, SwiGLU, tied or untied embeddings), the same batch shape and
the same synthetic token stream as benches/cpu_step.rs. Prints one JSON line.

Usage: python bench/torch_llama.py recipes/tiny.yaml [steps]
"""
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import yaml


class Block(torch.nn.Module):
    def __init__(self, c):
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
        self.gate = torch.nn.Linear(h, f, bias=False)
        self.up = torch.nn.Linear(h, f, bias=False)
        self.down = torch.nn.Linear(f, h, bias=False)

    def norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    @staticmethod
    def rope(x, cos, sin):
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
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        v, h = c["vocab_size"], c["hidden_size"]
        self.embed = torch.nn.Embedding(v, h)
        self.blocks = torch.nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
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

    def forward(self, tokens, labels):
        s = tokens.shape[1]
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos[:s], self.sin[:s])
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        logits = self.head(x).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def main():
    recipe = yaml.safe_load(open(sys.argv[1]))
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    c, t, o = recipe["model"], recipe["train"], recipe["optimizer"]
    b, s = t["micro_batch"], t["seq_len"]
    micro = t["global_batch"] // (t["micro_batch"] * recipe.get("parallel", {}).get("dp", 1))
    x, mask64 = 42, (1 << 64) - 1

    def nxt():
        nonlocal x
        x = (x * 6364136223846793005 + 1442695040888963407) & mask64
        return (x >> 33) % c["vocab_size"]

    batches = []
    for _ in range(micro):
        seqs = torch.tensor([[nxt() for _ in range(s + 1)] for _ in range(b)])
        batches.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()))
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


if __name__ == "__main__":
    main()
