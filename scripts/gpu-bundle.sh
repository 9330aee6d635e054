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
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-.gpu/bins}"
rm -rf "$out"
mkdir -p "$out/tests" "$out/bin" "$out/bench"
cargo test --release --workspace --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do
    cp "$exe" "$out/tests/$name"
done
cargo build --release -p braid-benches --bins -p braid-gpt2 --bin braid-gpt2
for b in dag_overhead allreduce_bw ddp_overlap gpt2_cpu gpt2_gpu braid-gpt2; do
    [ -x "target/release/$b" ] && cp "target/release/$b" "$out/bench/"
done
(cd tools/nvrtc-check && cargo build --release --quiet)
cp tools/nvrtc-check/target/release/nvrtc-check "$out/bin/"
echo "--root ." > "$out/bin/nvrtc-check.args"
strip "$out"/tests/* "$out"/bin/* "$out"/bench/* 2>/dev/null || true
du -sh "$out"
