#!/usr/bin/env bash
# Builds everything a GPU validation run needs (test harnesses, benchmark
# programs, the braid-gpt2 CLI, the NVRTC checker) in release mode on a
# machine with a Rust toolchain, and copies the stripped binaries into
# BUNDLE_DIR (default .gpu/bins) in the layout scripts/gpu-validate.sh expects:
#   tests/*  libtest harnesses       bin/*  checkers run as plain programs (+ NAME.args)
#   bench/*  benchmark programs and the braid-gpt2 CLI (not run by gpu-validate.sh;
#            run them with the arguments you want)
# Copy the bundle and the repository to the GPU machine, then run
#   scripts/gpu-validate.sh BUNDLE_DIR
#
# With --new, the bundle holds only what has never run on a GPU (see
# docs/gpu-validation.md, the "Not yet run" sections), as numbered wrappers
# in bin/ that gpu-validate.sh runs in priority order, each a harness with
# its filters or a benchmark with its arguments; the harnesses and programs
# they call sit in harness/ and bench/. Small enough to carry to a lent GPU
# machine, and ordered so that a short session does the most urgent first:
#   scripts/gpu-bundle.sh --new .gpu/new && scripts/gpu-validate.sh .gpu/new
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
new=0
if [ "${1:-}" = "--new" ]; then
    new=1
    shift
fi
out="${1:-.gpu/bins}"
rm -rf "$out"
mkdir -p "$out/tests" "$out/bin" "$out/bench"

# name -> path of every test harness of the workspace.
harnesses="$(cargo test --release --workspace --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        name = m["target"]["name"]
        # The library unit tests of each crate are named after the crate.
        if m["target"].get("kind") == ["lib"]:
            name = "lib_" + name.replace("-", "_")
        print(name, m["executable"])
')"
cargo build --release -p braid-benches --bins -p braid-gpt2 --bin braid-gpt2
(cd tools/nvrtc-check && cargo build --release --quiet)
cp tools/nvrtc-check/target/release/nvrtc-check "$out/bin/"
echo "--root ." > "$out/bin/nvrtc-check.args"

if [ "$new" -eq 0 ]; then
    while read -r name exe; do
        cp "$exe" "$out/tests/$name"
    done <<< "$harnesses"
    for b in dag_overhead allreduce_bw ddp_overlap gpt2_cpu gpt2_gpu gpt2_graphs braid-gpt2; do
        [ -x "target/release/$b" ] && cp "target/release/$b" "$out/bench/"
    done
else
    rmdir "$out/tests"
    mkdir -p "$out/harness"
    # Wrapper NN_label: runs harness H with ARGS, or benchmark B with ARGS.
    wrap() { # label kind name args...
        local label="$1" kind="$2" name="$3"
        shift 3
        local dir=harness src
        if [ "$kind" = bench ]; then
            dir=bench
            src="target/release/$name"
        else
            src="$(awk -v n="$name" '$1==n {print $2; exit}' <<< "$harnesses")"
        fi
        [ -n "$src" ] && [ -x "$src" ] || { echo "gpu-bundle: no $kind $name" >&2; exit 1; }
        [ -e "$out/$dir/$name" ] || cp "$src" "$out/$dir/$name"
        printf '#!/bin/sh\nexec "$(dirname "$0")/../%s/%s" %s\n' "$dir" "$name" "$*" > "$out/bin/$label"
        chmod +x "$out/bin/$label"
    }
    # Wrapper NN_label: a command run from the repository's root.
    script() { # label command
        printf '#!/bin/sh\nexec %s\n' "$2" > "$out/bin/$1"
        chmod +x "$out/bin/$1"
    }
    t="--test-threads=1"
    # CUDA graph replay (2026-11-26); then every GPT-2 CUDA kernel (bf16,
    # fused classifier, flash attention, residual + layer norm, AdamW step
    # scalars: 2026-11-25/26) against the CPU kernels, and the bf16 and
    # fused models against the PyTorch fixtures and the CPU's training.
    wrap 01_cuda_graphs test cuda "graph --nocapture $t"
    wrap 02_cuda_kernels test cuda_kernels "--nocapture $t"
    wrap 03_reference_cuda test reference_pytorch "cuda --nocapture $t"
    wrap 04_reference_bf16_cuda test reference_pytorch_bf16 "cuda --nocapture $t"
    wrap 05_cuda_model test cuda_model "--nocapture --skip cli_trains_on_one_gpu $t"
    wrap 06_cublas test lib_braid_cuda "cublas --nocapture $t"
    wrap 07_cuda test cuda "$t"
    wrap 08_replay test replay "$t"
    # Issue 12's side-by-side, one GPU, B 8 x T 1024: Braid fp32, bf16,
    # bf16 fused (each with a trace of one step of each policy under
    # $OUT); PyTorch bf16 autocast and fp32, SDPA.
    g="--batch-size 8 --seq-len 1024 --rounds 1 --warmup 2 --steps 6"
    wrap 09_gpt2_gpu_bf16 bench gpt2_gpu "$g --dtype bf16 --profile-step \$OUT/gpt2-bf16-step.json"
    script 10_pytorch_bf16 "python3 scripts/pytorch_gpt2_bench.py --dtype bf16 --fused-adamw --steps 8"
    wrap 11_gpt2_gpu_bf16_fused bench gpt2_gpu \
        "$g --dtype bf16 --fused --profile-step \$OUT/gpt2-bf16-fused-step.json"
    wrap 12_gpt2_gpu_fp32 bench gpt2_gpu "$g"
    script 13_pytorch_fp32 "python3 scripts/pytorch_gpt2_bench.py --steps 8"
    # The trainer as a user runs it on one GPU: bf16, graph replay.
    wrap 14_train_bf16_graphs bench braid-gpt2 \
        "train --device cuda --ranks 1 --model gpt2 --batch-size 8 --seq-len 1024 --steps 12 --no-trace --dtype bf16 --graphs"
    # Eager vs replay vs graph on the trainer's step.
    wrap 15_gpt2_graphs_small bench gpt2_graphs \
        "--device cuda --model small --batch-size 4 --seq-len 64 --rounds 3 --steps 20"
    wrap 16_gpt2_graphs_124m bench gpt2_graphs \
        "--device cuda --model gpt2 --batch-size 8 --seq-len 1024 --rounds 1 --steps 5 --dtype bf16"
    wrap 17_properties test properties "$t"
    rm -f "$out/bin/nvrtc-check.args"
    mv "$out/bin/nvrtc-check" "$out/bench/"
    printf '#!/bin/sh\nexec "$(dirname "$0")/../bench/nvrtc-check" --root .\n' > "$out/bin/00_nvrtc_check"
    chmod +x "$out/bin/00_nvrtc_check"
fi
strip "$out"/*/* 2>/dev/null || true
du -sh "$out"
