"""Checks an exported model with Hugging Face transformers.

Loads the directory written by `pretrain export-hf` with `LlamaForCausalLM.from_pretrained`, then
1. compares its logits on the first evaluation window with the logits `pretrain eval --logits-out`
   wrote (relative error = max |Δ| / max |logit|), and
2. computes the mean next-token loss over the same windows `pretrain eval` uses (the text tokenized
   without special tokens, consecutive windows of max_position_embeddings + 1 tokens, the last
   partial window dropped).

Usage: python scripts/hf_check.py EXPORT_DIR TEXT_FILE [LOGITS.safetensors]
Prints `hf_loss=<value>` and, with logits, `logit_rel_err=<value>`.
"""
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM


def main():
    export_dir, text_file = sys.argv[1], sys.argv[2]
    model = LlamaForCausalLM.from_pretrained(export_dir, torch_dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(export_dir)
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
        print(f"hf_loss={total / count:.8f} windows={n} tokens={count}")
        if len(sys.argv) > 3:
            ours = load_file(sys.argv[3])["logits"]
            theirs = model(windows[:1, :-1]).logits[0].float()
            err = (ours - theirs).abs().max().item() / theirs.abs().max().item()
            print(f"logit_rel_err={err:.3e}")


if __name__ == "__main__":
    main()
