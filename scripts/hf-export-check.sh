#!/usr/bin/env bash
# Loads the Hugging Face weights braid-gpt2 exports with `transformers`
# itself and checks that it scores text as braid-gpt2 does.
#
#   scripts/hf-export-check.sh [--python python3] [--model small] [--steps 40]
#
# --model: a model of GPT-2's vocabulary (small, gpt2, ...; not tiny).
#
# Trains --model for --steps steps on the built-in data (so the weights are
# not an initialisation's), exports them with `--save-weights DIR/`
# (model.safetensors + config.json), tokenizes README.md, and scores the
# tokens in windows of 64 with `braid-gpt2 eval --weights` (fp32) and with
# `GPT2LMHeadModel.from_pretrained(DIR)` in fp32, the same windows (window i:
# inputs i*T .. i*T+T-1, targets one token on). Fails if transformers reports
# a missing or unexpected weight, or if the two losses differ by more than
# 1e-5 relative. Needs a Python with torch, transformers and numpy
# (pip install torch transformers numpy); not part of CI, which has none.
set -euo pipefail
python=python3 model=small steps=40
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
cargo build --release -q -p braid-gpt2
bin=$PWD/target/release/braid-gpt2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" train --model "$model" --steps "$steps" --ranks 1 --batch-size 4 --seq-len 64 \
  --no-trace --save-weights "$tmp/hf/" > "$tmp/train.log" 2>&1 \
  || { cat "$tmp/train.log"; exit 1; }
"$bin" tokenize README.md "$tmp/text.bin" 2> /dev/null
# --model needs GPT-2's vocabulary: the text is GPT-2 BPE tokens.
"$bin" eval --weights "$tmp/hf/model.safetensors" --tokens "$tmp/text.bin" \
  --seq-len 64 --dtype fp32 > "$tmp/eval.out" 2> "$tmp/eval.err" \
  || { cat "$tmp/eval.err"; exit 1; }
braid=$(sed -n 's/^loss=//p' "$tmp/eval.out")
[ -n "$braid" ] || { echo "no loss= in braid-gpt2 eval's output:"; cat "$tmp/eval.out"; exit 1; }
echo "braid-gpt2 eval:  loss=$braid"
"$python" - "$tmp/hf" "$tmp/text.bin" 64 "$braid" <<'EOF'
import sys

import numpy as np
import torch
from transformers import GPT2LMHeadModel

path, tokens_file, t, braid = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
model, info = GPT2LMHeadModel.from_pretrained(
    path, torch_dtype=torch.float32, output_loading_info=True
)
bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
if bad:
    sys.exit(f"transformers did not load the weights as they are: {bad}")
model.eval()
header = np.fromfile(tokens_file, dtype=np.int32, count=256)
assert header[0] == 20240520, "not an llm.c token file"
ids = np.fromfile(tokens_file, dtype=np.uint16, offset=1024)[: header[2]].astype(np.int64)
windows = (len(ids) - 1) // t
x = torch.from_numpy(ids[: windows * t].reshape(windows, t))
y = torch.from_numpy(ids[1 : windows * t + 1].reshape(windows, t))
with torch.no_grad():
    logits = model(x).logits.double()
loss = torch.nn.functional.cross_entropy(
    logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
).item()
print(f"transformers:     loss={loss:.6f} ({windows} windows of {t}, transformers "
      f"{__import__('transformers').__version__}, torch {torch.__version__})")
rel = abs(loss - braid) / abs(loss)
if rel > 1e-5:
    sys.exit(f"the losses differ by {rel:.2e} relative")
print(f"same loss within {rel:.1e} relative")
EOF
