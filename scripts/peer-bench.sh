#!/usr/bin/env bash
# Braid's per-task overhead beside its peers, in one go:
#
#   1. configures and builds benches/peers (dag_peers: OpenMP tasks with depend,
#      a oneTBB flow graph) in target/peers, Release, and runs it;
#   2. runs dag_overhead (cargo, release) for the same shapes, in each mode:
#      eager (inferred and placed), auto (memoised steps), replay (recorded);
#   3. prints the figures side by side, in ns per task: median (best).
#
# Usage:  scripts/peer-bench.sh [--shape chain|fanout|random|all] [--tasks N]
#                               [--runs R] [--threads T]
#
# Defaults: all shapes, 100000 tasks, 5 runs, 2 threads. dag_overhead gets
# --runs as --reps and --threads as --streams (its compute streams; Braid's
# submitting thread comes on top of them). Needs cmake, g++ (which brings
# libgomp) and oneTBB: on Debian/Ubuntu, apt-get install cmake g++ libtbb-dev.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

shape=all tasks=100000 runs=5 threads=2
while [ $# -gt 0 ]; do
  if [ $# -lt 2 ]; then
    echo "peer-bench: $1 wants a value (see the usage at the top of $0)" >&2
    exit 2
  fi
  case "$1" in
    --shape) shape="$2" ;;
    --tasks) tasks="$2" ;;
    --runs) runs="$2" ;;
    --threads) threads="$2" ;;
    *) echo "peer-bench: unknown flag $1 (--shape, --tasks, --runs, --threads)" >&2; exit 2 ;;
  esac
  shift 2
done
case "$shape" in
  chain|fanout|random) shapes="$shape" ;;
  all) shapes="chain fanout random" ;;
  *) echo "peer-bench: unknown shape $shape (chain, fanout, random or all)" >&2; exit 2 ;;
esac

need="install them with: apt-get install -y cmake g++ libtbb-dev (libgomp comes with g++)"
for tool in cmake c++; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "peer-bench: $tool is missing; $need" >&2
    exit 1
  fi
done
if ! command -v cargo >/dev/null 2>&1; then
  echo "peer-bench: cargo is missing (needed for dag_overhead)" >&2
  exit 1
fi

echo "== build target/peers/dag_peers" >&2
mkdir -p target
if ! cmake -B target/peers -S benches/peers -DCMAKE_BUILD_TYPE=Release >target/peers-configure.log 2>&1; then
  cat target/peers-configure.log >&2
  echo "peer-bench: configuring benches/peers failed (OpenMP or oneTBB missing?); $need" >&2
  exit 1
fi
cmake --build target/peers -j "${BRAID_JOBS:-2}" >&2
echo "== build dag_overhead" >&2
cargo build --release -q -p braid-benches --bin dag_overhead

log="$(mktemp)"
trap 'rm -f "$log"' EXIT

echo "== peers"
target/peers/dag_peers --shape "$shape" --tasks "$tasks" --runs "$runs" --threads "$threads" | tee -a "$log"
echo "== braid"
for s in $shapes; do
  for m in eager auto replay; do
    target/release/dag_overhead --mode "$m" \
      --shape "$s" --tasks "$tasks" --reps "$runs" --streams "$threads" | tee -a "$log"
  done
done

echo
echo "== ns per task, median (best): $tasks empty tasks, $runs runs, $threads threads/streams"
awk -v shapes="$shapes" '
  {
    delete kv
    for (i = 1; i <= NF; i++) { split($i, p, "="); kv[p[1]] = p[2] }
    if (!("ns_per_task" in kv)) next
    col = ("peer" in kv) ? kv["peer"] " " kv["mode"] : "braid " kv["mode"]
    fig[tolower(kv["shape"]), col] = sprintf("%.0f (%.0f)", kv["ns_per_task"], kv["best_ns_per_task"])
  }
  END {
    ncol = split("braid eager|braid auto|braid replay|openmp inferred|tbb-flow built_and_run|tbb-flow run_only", cols, "|")
    printf "%-8s", "shape"
    for (c = 1; c <= ncol; c++) printf "  %-22s", cols[c]
    printf "\n"
    n = split(shapes, sh, " ")
    for (s = 1; s <= n; s++) {
      printf "%-8s", sh[s]
      for (c = 1; c <= ncol; c++) printf "  %-22s", ((sh[s], cols[c]) in fig) ? fig[sh[s], cols[c]] : "-"
      printf "\n"
    }
  }' "$log"
