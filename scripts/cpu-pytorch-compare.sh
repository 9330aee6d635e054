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
# Needs a Python with torch (pip install torch numpy); braid-gpt2 is built
# in release mode first.
set -euo pipefail
model=small threads=2 rounds=5 python=python3 steps=10
shapes=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --shape) shapes+=("$2"); shift 2 ;;
    --python) python=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
[ ${#shapes[@]} -gt 0 ] || shapes=(4x64 8x256)
cd "$(dirname "$0")/.."
cargo build --release -q -p braid-gpt2
bin=target/release/braid-gpt2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
for shape in "${shapes[@]}"; do
  b=${shape%x*} t=${shape#*x}
  : > "$tmp/braid" ; : > "$tmp/torch"
  for r in $(seq "$rounds"); do
    # braid: 2 warm-up steps, then $steps measured, one rank on $threads
    # cores (BRAID_CPU_CORES) with as many compute streams.
    BRAID_CPU_CORES=$threads "$bin" train --model "$model" --ranks 1 --streams "$threads" \
      --batch-size "$b" --seq-len "$t" --steps $((steps + 2)) --lr-schedule constant \
      --weight-decay-on all \
      --no-trace --metrics "$tmp/m.jsonl" > /dev/null 2>&1
    bm=$("$python" -c 'import json,sys,statistics
s=[json.loads(l)["seconds"] for l in open(sys.argv[1])][2:]
print(f"{statistics.median(s)*1e3:.1f}")' "$tmp/m.jsonl")
    tm=$("$python" scripts/pytorch_gpt2_bench.py --device cpu --impl nanogpt --model "$model" \
      --batch-size "$b" --seq-len "$t" --threads "$threads" --warmup 2 --steps "$steps" \
      --lr 2e-3 | sed -n 's/^step_ms=//p')
    echo "$bm" >> "$tmp/braid"; echo "$tm" >> "$tmp/torch"
    echo "model=$model B=$b T=$t threads=$threads round=$r braid_ms=$bm pytorch_ms=$tm"
  done
  bmed=$(median < "$tmp/braid") tmed=$(median < "$tmp/torch")
  echo "model=$model B=$b T=$t threads=$threads braid_median_ms=$bmed pytorch_median_ms=$tmed" \
    "pytorch_over_braid=$(awk -v a="$tmed" -v b="$bmed" 'BEGIN {printf "%.2f", a/b}')"
done
