#!/usr/bin/env bash
# Checks the step simulator against measured CPU runs (docs/simulator.md):
# traces a source configuration of `braid-gpt2 train`, traces the target
# configuration, and predicts the target from the source. Each run prints the
# cores' worth of other work that ran beside it (this VM is shared), which
# is passed to the simulator as --background.
#
#   scripts/simulate-check.sh OUTDIR "SOURCE FLAGS" "TARGET FLAGS" "SIMULATE FLAGS"
#   scripts/simulate-check.sh /tmp/sim "--ranks 1 --policy single" "--ranks 1" "--ranks 1 --streams 2"
#
# Runs from the repository root whatever the current directory (OUTDIR is
# taken relative to the current one). The binaries come from
# $CARGO_TARGET_DIR/release (default target/release), built first. Earlier
# outputs in OUTDIR (source.json, target.json, their .log files, time,
# predicted.json) are removed before the runs; a failed training run fails
# the script and prints the tail of its log.
set -euo pipefail
usage() {
    echo "usage: scripts/simulate-check.sh OUTDIR \"SOURCE FLAGS\" \"TARGET FLAGS\" \"SIMULATE FLAGS\"" >&2
    echo "  e.g. scripts/simulate-check.sh /tmp/sim \"--ranks 1 --policy single\" \"--ranks 1\" \"--ranks 1 --streams 2\"" >&2
    exit 2
}
[ $# -eq 4 ] || usage
out=$1 src=$2 dst=$3 sim=$4
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
target=${CARGO_TARGET_DIR:-target}
cargo build --release -q -p braid-gpt2 -p braid-benches --bin braid-gpt2 --bin simulate
rm -f "$out/source.json" "$out/source.json.log" "$out/target.json" "$out/target.json.log" \
    "$out/time" "$out/predicted.json"
train=(train --model small --steps 12 --reduce-single-rank)
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9}' /proc/stat; }
# Runs braid-gpt2 with the given flags and trace path; prints the background.
# Called inside $(...), where set -e does not stop the script: every failure
# is checked explicitly, and the caller checks the status.
run() {
    local trace=$1; shift
    local b0 b1 t0 t1 ours
    b0=$(busy); t0=$(date +%s.%N)
    if ! /usr/bin/time -f "%U %S" -o "$out/time" "$target/release/braid-gpt2" "${train[@]}" "$@" \
        --trace "$trace" > "$trace.log" 2>&1; then
        {
            echo "simulate-check: braid-gpt2 ${train[*]} $* --trace $trace failed; the end of $trace.log:"
            tail -n 20 "$trace.log"
        } >&2
        return 1
    fi
    [ -s "$trace" ] || { echo "simulate-check: no trace written to $trace (see $trace.log)" >&2; return 1; }
    b1=$(busy); t1=$(date +%s.%N)
    ours=$(awk '{print $1+$2}' "$out/time") || return 1
    awk -v b0="$b0" -v b1="$b1" -v t0="$t0" -v t1="$t1" -v ours="$ours" -v hz="$(getconf CLK_TCK)" \
        'BEGIN { bg = ((b1 - b0) / hz - ours) / (t1 - t0); if (bg < 0) bg = 0; printf "%.2f", bg }'
}
# shellcheck disable=SC2086
bg_src=$(run "$out/source.json" $src) || { echo "simulate-check: the source run failed" >&2; exit 1; }
# shellcheck disable=SC2086
bg_dst=$(run "$out/target.json" $dst) || { echo "simulate-check: the target run failed" >&2; exit 1; }
echo "source: $src (background $bg_src cores); target: $dst (background $bg_dst cores)"
# shellcheck disable=SC2086
"$target/release/simulate" --trace "$out/source.json" $sim --background "$bg_dst" \
    --traced-background "$bg_src" \
    --measured "$out/target.json" --path-tasks 6 --out "$out/predicted.json"
