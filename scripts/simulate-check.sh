#!/usr/bin/env bash
# Checks the step simulator against measured CPU runs (docs/simulator.md):
# traces a source configuration of `braid-gpt2 train`, traces the target
# configuration, and predicts the target from the source. Each run prints the
# cores' worth of other work that ran beside it (this VM is shared), which
# is passed to the simulator as --background.
#
#   scripts/simulate-check.sh OUTDIR "SOURCE FLAGS" "TARGET FLAGS" "SIMULATE FLAGS"
#   scripts/simulate-check.sh /tmp/sim "--ranks 1 --policy single" "--ranks 1" "--ranks 1 --streams 2"
set -euo pipefail
out=$1 src=$2 dst=$3 sim=$4
mkdir -p "$out"
target=${CARGO_TARGET_DIR:-target}
cargo build --release -q -p braid-gpt2 -p braid-benches --bin braid-gpt2 --bin simulate
train=(train --model small --steps 12 --reduce-single-rank)
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9}' /proc/stat; }
# Runs braid-gpt2 with the given flags and trace path; prints the background.
run() {
    local trace=$1; shift
    local b0 b1 t0 t1 ours
    b0=$(busy); t0=$(date +%s.%N)
    /usr/bin/time -f "%U %S" -o "$out/time" "$target/release/braid-gpt2" "${train[@]}" "$@" \
        --trace "$trace" > "$trace.log" 2>&1
    b1=$(busy); t1=$(date +%s.%N)
    ours=$(awk '{print $1+$2}' "$out/time")
    awk -v b0="$b0" -v b1="$b1" -v t0="$t0" -v t1="$t1" -v ours="$ours" -v hz="$(getconf CLK_TCK)" \
        'BEGIN { bg = ((b1 - b0) / hz - ours) / (t1 - t0); if (bg < 0) bg = 0; printf "%.2f", bg }'
}
# shellcheck disable=SC2086
bg_src=$(run "$out/source.json" $src)
# shellcheck disable=SC2086
bg_dst=$(run "$out/target.json" $dst)
echo "source: $src (background $bg_src cores); target: $dst (background $bg_dst cores)"
# shellcheck disable=SC2086
"$target/release/simulate" --trace "$out/source.json" $sim --background "$bg_dst" \
    --traced-background "$bg_src" \
    --measured "$out/target.json" --path-tasks 6 --out "$out/predicted.json"
