#!/usr/bin/env bash
# The CLI's GPU paths a user reaches after training: `train` on CUDA saving
# a checkpoint and Hugging Face weights, then `eval` and `sample` from them
# on CUDA (bf16, their GPU default) and on the CPU (fp32) for comparison,
# and `sample --checkpoint` on CUDA. Prints what each printed; fails if any
# command fails. Run from the repository root (README.md is the text that
# `eval` scores).
#
# Usage: scripts/gpu-cli-check.sh PATH/TO/braid-gpt2 [DEVICE]
# DEVICE (default cuda) is where training runs and is compared with the CPU;
# `cpu` runs the same commands on a machine without a GPU.
set -euo pipefail
BIN="${1:?usage: gpu-cli-check.sh PATH/TO/braid-gpt2 [DEVICE]}"
GPU="${2:-cuda}"
DIR="$(mktemp -d "${TMPDIR:-/tmp}/braid-cli-check.XXXXXX")"
trap 'rm -rf "$DIR"' EXIT
run() { echo "+ braid-gpt2 $*"; "$BIN" "$@"; }
run train --device "$GPU" --model small --batch-size 4 --seq-len 64 --steps 30 \
    --checkpoint-dir "$DIR/ckpt" --save-weights "$DIR/small.safetensors" --no-trace
for dev in "$GPU" cpu; do
    run eval --device "$dev" --weights "$DIR/small.safetensors" --tokens README.md --seq-len 64
    run sample --device "$dev" --weights "$DIR/small.safetensors" --prompt "The engine" \
        --tokens 24 --temperature 0
done
run sample --device "$GPU" --checkpoint "$DIR/ckpt" --prompt "The engine" --tokens 24 --temperature 0
