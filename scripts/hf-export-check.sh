#!/usr/bin/env bash
# Loads the Hugging Face weights braid-gpt2 exports with `transformers`
# itself and checks that it scores text as braid-gpt2 does.
#
#   scripts/hf-export-check.sh [--python python3] [--model small] [--steps 40]
#
# --model: a model of GPT-2's vocabulary (small, gpt2, ...; not tiny).
#
# Tokenizes README.md, trains --model for --steps steps on those tokens (so
# the weights are neither an initialisation's nor near uniform: the model must
# score the text better than uniform, ln(vocabulary), or the check fails, as
# it would hardly notice a wrong weight), exports them with
# `--save-weights DIR/` (model.safetensors + config.json), and scores the
# tokens in windows of 64 with `braid-gpt2 eval --weights` (fp32) and with
# `GPT2LMHeadModel.from_pretrained(DIR)` in fp32, the same windows (window i:
# inputs i*T .. i*T+T-1, targets one token on). Fails if transformers reports
# a missing or unexpected weight, or if the two mean losses over all the
# windows, or over the first 1, 2, 4, ... 64, differ by more than 3e-7
# relative: they differ by up to ~1e-7 (summation order, and eval prints 6
# decimals), and one layer norm's weight scaled by 1.0001 moves one of them
# by 4.6e-7 to 1.2e-4 (five tried, with the default 40 steps). Needs a Python
# with torch, transformers and numpy (pip install torch transformers numpy;
# checked first, pass --python to pick one); not part of CI, which has none.
# braid-gpt2 is built in release mode first, in $CARGO_TARGET_DIR when set,
# else target/.
set -euo pipefail
usage() {
  [ $# -eq 0 ] || echo "hf-export-check: $*" >&2
  echo "usage: scripts/hf-export-check.sh [--python python3] [--model small] [--steps 40]" >&2
  exit 2
}
python=python3 model=small steps=40
while [ $# -gt 0 ]; do
  case "$1" in
    --python|--model|--steps) [ $# -ge 2 ] || usage "$1 needs a value" ;;
  esac
  case "$1" in
    --python) python=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    -h|--help) usage ;;
    *) usage "unknown argument: $1" ;;
  esac
done
# Check the Python before building and running anything (a relative path is
# taken from the current directory, not the repository root).
case "$python" in
  */*) d=$(cd "$(dirname "$python")" 2> /dev/null && pwd) && python=$d/$(basename "$python") ;;
esac
command -v "$python" > /dev/null \
  || { echo "hf-export-check: no $python found; pass --python PATH (a Python with torch, transformers and numpy)" >&2
       exit 1; }
"$python" -c 'import numpy, torch, transformers' 2> /dev/null \
  || { echo "hf-export-check: $python cannot import numpy, torch and transformers:" \
         "pip install torch transformers numpy, or pass --python PATH" >&2; exit 1; }
cd "$(dirname "$0")/.."
cargo build --release -q -p braid-gpt2
target=${CARGO_TARGET_DIR:-target}
bin=$(cd "$target/release" && pwd)/braid-gpt2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" tokenize README.md "$tmp/text.bin" 2> "$tmp/tokenize.err" \
  || { echo "hf-export-check: braid-gpt2 tokenize README.md failed:" >&2; cat "$tmp/tokenize.err" >&2; exit 1; }
"$bin" train --model "$model" --steps "$steps" --ranks 1 --batch-size 4 --seq-len 64 \
  --data "$tmp/text.bin" --no-trace --save-weights "$tmp/hf/" > "$tmp/train.log" 2>&1 \
  || { echo "hf-export-check: braid-gpt2 train failed:" >&2; cat "$tmp/train.log" >&2; exit 1; }
# The mean loss over all the windows, and over the first 1, 2, 4, ... 64:
# a wrong weight can move one mean very little (its effects on the windows
# cancel out), hardly every one of them.
scores=()
for n in 1 2 4 8 16 32 64 all; do
  w=(); [ "$n" = all ] || w=(--windows "$n")
  "$bin" eval --weights "$tmp/hf/model.safetensors" --tokens "$tmp/text.bin" \
    --seq-len 64 --dtype fp32 "${w[@]}" > "$tmp/eval.out" 2> "$tmp/eval.err" \
    || { echo "hf-export-check: braid-gpt2 eval (windows: $n) failed:" >&2; cat "$tmp/eval.err" >&2; exit 1; }
  loss=$(sed -n 's/^loss=//p' "$tmp/eval.out")
  [ -n "$loss" ] || { echo "hf-export-check: no loss= in braid-gpt2 eval's output:" >&2; cat "$tmp/eval.out" >&2; exit 1; }
  scores+=("$n=$loss")
done
echo "braid-gpt2 eval:  loss=$loss (first 1, 2, 4, ... windows: ${scores[*]})"
"$python" - "$tmp/hf" "$tmp/text.bin" 64 "${scores[@]}" <<'EOF'
import math
import sys

import numpy as np
import torch
from transformers import GPT2LMHeadModel

path, tokens_file, t = sys.argv[1], sys.argv[2], int(sys.argv[3])
braid = dict(a.split("=") for a in sys.argv[4:])  # windows (or "all") -> loss
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
per_window = torch.nn.functional.cross_entropy(
    logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none"
).reshape(windows, t).mean(dim=1)
loss = per_window.mean().item()
print(f"transformers:     loss={loss:.6f} ({windows} windows of {t}, transformers "
      f"{__import__('transformers').__version__}, torch {torch.__version__})")
uniform = math.log(model.config.vocab_size)
if loss >= uniform:
    sys.exit(f"the trained model scores no better than uniform (ln {model.config.vocab_size} "
             f"= {uniform:.4f}): a wrong weight would hardly show; use more --steps")
worst = (0.0, None)
for n, b in braid.items():
    k = windows if n == "all" else min(int(n), windows)
    ours = per_window[:k].mean().item()
    rel = abs(ours - float(b)) / abs(ours)
    print(f"  first {k} windows: braid-gpt2 {float(b):.6f}, transformers {ours:.6f}, {rel:.1e} relative")
    worst = max(worst, (rel, k))
if worst[0] > 3e-7:
    sys.exit(f"the losses differ by {worst[0]:.2e} relative (first {worst[1]} windows)")
print(f"same losses within {worst[0]:.1e} relative (tolerance 3e-7; uniform would score {uniform:.4f})")
EOF
