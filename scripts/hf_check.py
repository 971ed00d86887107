"""Checks models against Hugging Face transformers.

Two uses:

    python scripts/hf_check.py MODEL_DIR TEXT_FILE [LOGITS.safetensors]

loads MODEL_DIR (an export of `pretrain export-hf`, or any Llama or Mixtral directory) with
`AutoModelForCausalLM.from_pretrained` (the class its config.json names: LlamaForCausalLM or
MixtralForCausalLM), then
1. computes the mean next-token loss over the windows `pretrain eval` uses (the text tokenized
   without special tokens, consecutive windows of max_position_embeddings + 1 tokens, the last
   partial window dropped), and
2. with LOGITS (written by `pretrain eval --logits-out`), compares the first window's logits
   (relative error = max |Δ| / max |logit|).
It prints `hf_loss=<value>` and, with logits, `logit_rel_err=<value>`, and the transformers version.

    python scripts/hf_check.py make OUT_DIR --tokenizer TOKENIZER.json --config JSON [--seed N]
        [--arch llama|mixtral]

writes a randomly initialised transformers Llama (or Mixtral) to OUT_DIR: JSON holds LlamaConfig
(MixtralConfig) keyword arguments (e.g. `rope_parameters` with `rope_type: llama3`), the config is saved in the running
transformers' own format (transformers 5 writes `rope_parameters`), and the tokenizer is saved next
to it so that `pretrain import-hf` and this script read the same vocabulary.
"""
import argparse
import json
import sys

import torch
import transformers
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast)


def check(model_dir, text_file, logits_file):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    print(f"architecture={type(model).__name__}")
    model.eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(open(text_file).read(), add_special_tokens=False)["input_ids"]
    s = model.config.max_position_embeddings
    n = len(ids) // (s + 1)
    windows = torch.tensor(ids[: n * (s + 1)]).view(n, s + 1)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in windows.split(8):
            logits = model(batch[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
            total += loss.double().item()
            count += batch[:, 1:].numel()
        print(f"transformers={transformers.__version__}")
        print(f"hf_loss={total / count:.8f} windows={n} tokens={count}")
        if logits_file:
            ours = load_file(logits_file)["logits"]
            theirs = model(windows[:1, :-1]).logits[0].float()
            err = (ours - theirs).abs().max().item() / theirs.abs().max().item()
            print(f"logit_rel_err={err:.3e}")


def make(out_dir, tokenizer_file, config_json, seed, arch):
    torch.manual_seed(seed)
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
    }[arch]
    model = model_class(config_class(**json.loads(config_json)))
    model.save_pretrained(out_dir)
    tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, bos_token="<|endoftext|>",
                                  eos_token="<|endoftext|>")
    tok.save_pretrained(out_dir)
    print(f"wrote {out_dir} with transformers {transformers.__version__}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "make":
        p = argparse.ArgumentParser(prog="hf_check.py make")
        p.add_argument("out_dir")
        p.add_argument("--tokenizer", required=True)
        p.add_argument("--config", required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--arch", choices=["llama", "mixtral"], default="llama")
        a = p.parse_args(sys.argv[2:])
        make(a.out_dir, a.tokenizer, a.config, a.seed, a.arch)
    else:
        check(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)


if __name__ == "__main__":
    main()
