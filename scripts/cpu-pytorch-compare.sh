#!/usr/bin/env bash
# GPT-2 training steps on the CPU: braid-gpt2 (one rank, its default
# placement) against PyTorch (scripts/pytorch_gpt2_bench.py, the same model,
# fp32, AdamW, clipping) on as many threads, taking turns round by round.
# Prints each run's median step time and, per shape, the medians over the
# rounds and PyTorch's / braid's ratio. Figures only.
#
#   scripts/cpu-pytorch-compare.sh [--model small] [--threads 2] [--rounds 5]
#       [--shape 4x64] [--shape 8x256] [--python python3]
#
# Needs a Python with torch (pip install torch numpy; checked first, pass
# --python to pick one); braid-gpt2 is built in release mode first, in
# $CARGO_TARGET_DIR when set, else target/.
set -euo pipefail
usage() {
  [ $# -eq 0 ] || echo "cpu-pytorch-compare: $*" >&2
  echo "usage: scripts/cpu-pytorch-compare.sh [--model small] [--threads 2] [--rounds 5]" \
    "[--shape BxT]... [--python python3]" >&2
  exit 2
}
model=small threads=2 rounds=5 python=python3 steps=10
shapes=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model|--threads|--rounds|--shape|--python)
      [ $# -ge 2 ] || usage "$1 needs a value" ;;
  esac
  case "$1" in
    --model) model=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --shape) shapes+=("$2"); shift 2 ;;
    --python) python=$2; shift 2 ;;
    -h|--help) usage ;;
    *) usage "unknown argument: $1" ;;
  esac
done
[ ${#shapes[@]} -gt 0 ] || shapes=(4x64 8x256)
for shape in "${shapes[@]}"; do
  [[ $shape =~ ^[0-9]+x[0-9]+$ ]] || usage "--shape $shape: expected BxT, e.g. 4x64"
done
# Check the Python before building and running anything (a relative path is
# taken from the current directory, not the repository root).
case "$python" in
  */*) d=$(cd "$(dirname "$python")" 2> /dev/null && pwd) && python=$d/$(basename "$python") ;;
esac
command -v "$python" > /dev/null \
  || { echo "cpu-pytorch-compare: no $python found; pass --python PATH (a Python with torch)" >&2; exit 1; }
"$python" -c 'import torch' 2> /dev/null \
  || { echo "cpu-pytorch-compare: $python cannot import torch; pip install torch, or pass --python PATH" \
         "(a Python with torch)" >&2; exit 1; }
cd "$(dirname "$0")/.."
cargo build --release -q -p braid-gpt2
target=${CARGO_TARGET_DIR:-target}
bin=$(cd "$target/release" && pwd)/braid-gpt2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
for shape in "${shapes[@]}"; do
  b=${shape%x*} t=${shape#*x}
  : > "$tmp/braid" ; : > "$tmp/torch"
  for r in $(seq "$rounds"); do
    rm -f "$tmp/m.jsonl"
    # braid: 2 warm-up steps, then $steps measured, one rank on $threads
    # cores (BRAID_CPU_CORES) with as many compute streams.
    BRAID_CPU_CORES=$threads "$bin" train --model "$model" --ranks 1 --streams "$threads" \
      --batch-size "$b" --seq-len "$t" --steps $((steps + 2)) --lr-schedule constant \
      --weight-decay-on all \
      --no-trace --metrics "$tmp/m.jsonl" > "$tmp/braid.log" 2>&1 || {
      echo "cpu-pytorch-compare: braid-gpt2 train failed (model=$model B=$b T=$t threads=$threads round=$r):" >&2
      tail -n 20 "$tmp/braid.log" >&2
      exit 1
    }
    bm=$("$python" -c 'import json,sys,statistics
s=[json.loads(l)["seconds"] for l in open(sys.argv[1])][2:]
print(f"{statistics.median(s)*1e3:.1f}")' "$tmp/m.jsonl")
    tm=$("$python" scripts/pytorch_gpt2_bench.py --device cpu --impl nanogpt --model "$model" \
      --batch-size "$b" --seq-len "$t" --threads "$threads" --warmup 2 --steps "$steps" \
      --lr 2e-3 | sed -n 's/^step_ms=//p')
    [ -n "$tm" ] || { echo "cpu-pytorch-compare: no step_ms= in pytorch_gpt2_bench.py's output" >&2; exit 1; }
    echo "$bm" >> "$tmp/braid"; echo "$tm" >> "$tmp/torch"
    echo "model=$model B=$b T=$t threads=$threads round=$r braid_ms=$bm pytorch_ms=$tm"
  done
  bmed=$(median < "$tmp/braid") tmed=$(median < "$tmp/torch")
  echo "model=$model B=$b T=$t threads=$threads braid_median_ms=$bmed pytorch_median_ms=$tmed" \
    "pytorch_over_braid=$(awk -v a="$tmed" -v b="$bmed" 'BEGIN {printf "%.2f", a/b}')"
done
