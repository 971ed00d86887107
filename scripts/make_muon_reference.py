"""Writes src/optim/muon/torch_reference.json: torch.optim.Muon's parameters over 10 steps on
small matrices, for the optimizer's tests to compare with.

torch.optim.Muon iterates Newton-Schulz in bf16 whatever the parameters' dtype; to compare in
f32 the reference runs torch's own Muon code with `torch.bfloat16` read as `torch.float32`
inside its module (nothing else changes). Initial values and gradients come from a formula
both sides compute (`value` below, rounded to f32), so the file holds only the results.

    python3 -m venv v && v/bin/pip install torch && v/bin/python scripts/make_muon_reference.py
"""

import json
import math
import sys
import types

import torch
import torch.optim._muon as muon_module

STEPS = 10

CASES = [
    # name, shape, lr, weight_decay, momentum, nesterov, adjust_lr, ns_steps, coefficients, eps
    ("default_wide", (12, 20), 0.02, 0.1, 0.95, True, "original", 5, (3.4445, -4.775, 2.0315), 1e-7),
    ("tall_plain_rms", (20, 12), 0.01, 0.0, 0.3, False, "match_rms_adamw", 5, (3.4445, -4.775, 2.0315), 1e-7),
    ("square_custom", (16, 16), 0.05, 0.2, 0.9, True, "original", 3, (2.0, -1.5, 0.5), 1e-5),
]


def value(kind, t, i, j):
    """The formula for initial values (t = 0, kind 0) and step t's gradients (kind 1)."""
    if kind == 0:
        return 0.1 * math.sin(0.37 * i + 0.11 * j + 0.5)
    return math.sin(0.29 * i * (t % 3 + 1) + 0.13 * j + 0.7 * t) * (1.0 + 0.25 * t)


def matrix(kind, t, shape):
    rows, cols = shape
    return torch.tensor(
        [[value(kind, t, i, j) for j in range(cols)] for i in range(rows)], dtype=torch.float32
    )


def main():
    # torch's Muon code, its iteration in f32.
    f32_torch = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    f32_torch.bfloat16 = torch.float32
    muon_module.torch = f32_torch
    out = {"torch": torch.__version__, "steps": STEPS, "cases": []}
    for name, shape, lr, wd, mom, nesterov, adjust, ns_steps, coeffs, eps in CASES:
        p = torch.nn.Parameter(matrix(0, 0, shape))
        opt = torch.optim.Muon(
            [p], lr=lr, weight_decay=wd, momentum=mom, nesterov=nesterov,
            ns_coefficients=coeffs, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust,
        )
        after = []
        for t in range(1, STEPS + 1):
            p.grad = matrix(1, t, shape)
            opt.step()
            after.append([float("%.9g" % x) for x in p.detach().flatten().tolist()])
        out["cases"].append({
            "name": name, "shape": list(shape), "lr": lr, "weight_decay": wd, "momentum": mom,
            "nesterov": nesterov, "adjust_lr": adjust, "ns_steps": ns_steps,
            "ns_coefficients": list(coeffs), "eps": eps, "after": after,
        })
    path = sys.argv[1] if len(sys.argv) > 1 else "src/optim/muon/torch_reference.json"
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
