"""PyTorch's side of bench/torch_match.sh: the weights `benches/torch_match.rs` started from,
trained with torch.optim on the same synthetic token stream, f32 on the CPU, constant learning
rate, no clipping. Prints `{"losses": [...]}`.

    python bench/torch_match.py recipes/tiny.yaml STEPS init.safetensors [--set optimizer.name=muon]

Optimizers, as `pretrain` assigns them: with `optimizer.name: muon`, torch.optim.Muon for the
attention and MLP projections (its own code, with its Newton-Schulz iteration in f32, as ours
runs on the CPU: `torch.bfloat16` is read as `torch.float32` inside torch's Muon module) and
torch.optim.AdamW for the rest; with `adamw`, AdamW for everything. Weight decay as `pretrain`
applies it: projection matrices (and the output matrix), not norms, the embedding only with
`optimizer.decay_embeddings`.
"""

import argparse
import json
import os
import sys
import types

import torch
import torch.optim._muon as muon_module
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(__file__))
from torch_llama import Llama, load_recipe, shapes, synthetic_batches  # noqa: E402

HIDDEN = ("q", "k", "v", "o", "gate", "up", "down")


def ours_to_torch(name):
    """A Hugging Face parameter name -> torch_llama.py's."""
    if name == "model.embed_tokens.weight":
        return "embed.weight"
    if name == "model.norm.weight":
        return "norm"
    if name == "lm_head.weight":
        return "head.weight"
    parts = name.split(".")  # model.layers.I.<module>.<proj>.weight
    i, module = parts[2], parts[3]
    if module == "input_layernorm":
        return f"blocks.{i}.ln1"
    if module == "post_attention_layernorm":
        return f"blocks.{i}.ln2"
    return f"blocks.{i}.{parts[4].removesuffix('_proj')}.weight"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("recipe")
    p.add_argument("steps", type=int)
    p.add_argument("weights")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    c, t, b, s, micro = shapes(recipe)
    o = recipe["optimizer"]
    torch.manual_seed(0)
    model = Llama(c)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in load_file(args.weights).items():
            params[ours_to_torch(name)].copy_(value)

    lr, wd = float(o["lr"]), float(o.get("weight_decay", 0.1))
    muon = o.get("name", "adamw") == "muon"
    hidden, decayed, plain = [], [], []
    for name, p_ in model.named_parameters():
        last = name.split(".")[-2] if name.endswith(".weight") else ""
        if name.startswith("blocks.") and last in HIDDEN:
            hidden.append(p_)
        elif name == "head.weight" or (name == "embed.weight" and o.get("decay_embeddings", False)):
            decayed.append(p_)
        else:
            plain.append(p_)
    adamw_kw = dict(lr=lr, betas=(float(o.get("beta1", 0.9)), float(o.get("beta2", 0.95))),
                    eps=float(o.get("eps", 1e-8)))
    groups = [{"params": decayed, "weight_decay": wd}, {"params": plain, "weight_decay": 0.0}]
    optimizers = []
    if muon:
        m = o.get("muon", {}) or {}
        f32_torch = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
        f32_torch.bfloat16 = torch.float32
        muon_module.torch = f32_torch
        optimizers.append(torch.optim.Muon(
            hidden, lr=lr, weight_decay=wd, momentum=float(m.get("momentum", 0.95)),
            nesterov=bool(m.get("nesterov", True)),
            ns_coefficients=tuple(m.get("ns_coefficients", (3.4445, -4.775, 2.0315))),
            eps=float(m.get("eps", 1e-7)), ns_steps=int(m.get("ns_steps", 5)),
            adjust_lr_fn=m.get("adjust_lr", "original")))
    else:
        groups.append({"params": hidden, "weight_decay": wd})
    optimizers.append(torch.optim.AdamW([g for g in groups if g["params"]], **adamw_kw))

    batches = synthetic_batches(c["vocab_size"], micro, b, s)
    losses = []
    for _ in range(args.steps):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        total = 0.0
        for tok, lab in batches:
            loss = model(tok, lab) / micro
            loss.backward()
            total += float(loss.detach())
        for opt in optimizers:
            opt.step()
        losses.append(total)
    print(json.dumps({"optimizer": "muon" if muon else "adamw", "torch": torch.__version__, "losses": losses}))


if __name__ == "__main__":
    main()
