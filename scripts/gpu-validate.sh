#!/usr/bin/env bash
# Runs prebuilt Braid binaries on the GPU validation machine (no Rust toolchain
# there) with BRAID_REQUIRE_GPU=1, so a test that cannot reach the GPU fails
# instead of skipping. Logs go to $OUT.
#
# Usage:  scripts/gpu-validate.sh BIN_DIR
#
# BIN_DIR layout (built here with `cargo test --no-run --release` and copied):
#   BIN_DIR/tests/*        libtest harnesses: run as `BIN --test-threads=1`
#                          (override with BRAID_TEST_ARGS)
#   BIN_DIR/bin/*          plain programs (benchmarks, nvrtc-check); arguments
#                          from BIN_DIR/bin/NAME.args if that file exists
#   BIN_DIR/*              executables at the top level count as libtest harnesses
#
# Environment:
#   OUT                 where logs go (default ./gpu-validate-out)
#   TORCH_VENV          venv with NVIDIA's pip wheels (default /opt/torch/.venv)
#   BRAID_TEST_TIMEOUT  seconds per binary (default 900)
#   BRAID_TEST_ARGS     arguments for libtest harnesses (default --test-threads=1)
#   BRAID_VALIDATE_PACK 1: at the end, pack everything under $OUT into
#                       $OUT/gpu-validate.tgz and remove the loose files (for
#                       a way back that takes few files)
#
#   BRAID_VALIDATE_ALL  1: run the programs BIN_DIR/needs keeps to other GPUs
#
# BIN_DIR/order and BIN_DIR/needs (optional; written by gpu-bundle.sh --quick)
# set the programs' order and the GPUs some of them are for (below).
#
# Exit status: 0 when every binary that ran exited 0, 1 otherwise. The last
# line is "N passed, N failed, N skipped".
set -uo pipefail

BIN_DIR="${1:?usage: gpu-validate.sh BIN_DIR}"
OUT="${OUT:-$PWD/gpu-validate-out}"
# The wrappers write traces under $OUT.
export OUT
TORCH_VENV="${TORCH_VENV:-/opt/torch/.venv}"
TIMEOUT="${BRAID_TEST_TIMEOUT:-900}"
TEST_ARGS="${BRAID_TEST_ARGS:---test-threads=1}"
mkdir -p "$OUT/logs"
ENV_LOG="$OUT/environment.txt"

# --- libraries --------------------------------------------------------------
# NVIDIA's wheels install under site-packages/nvidia/<pkg>/lib (CUDA 12 wheels)
# or site-packages/nvidia/cu13/lib (CUDA 13 wheels); `nvidia` is a namespace
# package, so ask Python where its parts are.
PY="$TORCH_VENV/bin/python3"
[ -x "$PY" ] || PY="$(command -v python3 || true)"
LIB_DIRS=""
if [ -n "$PY" ]; then
    LIB_DIRS="$("$PY" - <<'PYEOF' 2>/dev/null
import glob, os
try:
    import nvidia
except ImportError:
    raise SystemExit(0)
dirs = []
for base in list(nvidia.__path__):
    for d in sorted(glob.glob(os.path.join(base, "*", "lib"))):
        if glob.glob(os.path.join(d, "*.so*")):
            dirs.append(d)
print(":".join(dirs))
PYEOF
)"
fi

# cudarc loads libnccl.so / .so.13 / ..., not libnccl.so.2 (the wheel's only
# name); give it a directory of unversioned symlinks for what lacks one.
SHIM="$(mktemp -d "${TMPDIR:-/tmp}/braid-libshim.XXXXXX")"
IFS=':' read -r -a dirs <<< "$LIB_DIRS"
for d in "${dirs[@]}" /usr/local/cuda/lib64; do
    [ -d "$d" ] || continue
    for f in "$d"/lib*.so.*; do
        [ -e "$f" ] || continue
        base="$(basename "$f")"
        stem="${base%%.so.*}"
        if [ ! -e "$d/$stem.so" ] && [ ! -e "$SHIM/$stem.so" ]; then
            ln -s "$f" "$SHIM/$stem.so"
        fi
    done
done

export LD_LIBRARY_PATH="$SHIM${LIB_DIRS:+:$LIB_DIRS}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export BRAID_REQUIRE_GPU=1
export BRAID_REQUIRE_NVRTC=1
export BRAID_KERNEL_CACHE_DIR="${BRAID_KERNEL_CACHE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/braid-kcache.XXXXXX")}"
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(hostname)"
    echo "kernel: $(uname -r)"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "shim links:"; ls -l "$SHIM" | sed 's/^/  /'
    echo "--- nvidia-smi"
    nvidia-smi 2>&1 || echo "nvidia-smi failed"
    echo "--- nvidia-smi topo -m"
    nvidia-smi topo -m 2>&1 || true
    echo "--- nvcc --version"
    (command -v nvcc >/dev/null && nvcc --version) || (/usr/local/cuda/bin/nvcc --version 2>&1) || echo "no nvcc"
    echo "--- CUDA libraries found"
    for lib in libcuda.so.1 libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2 libnccl.so libcudnn.so.9; do
        hit=""
        IFS=':' read -r -a p <<< "$LD_LIBRARY_PATH"
        for d in "${p[@]}"; do
            [ -e "$d/$lib" ] && { hit="$d/$lib"; break; }
        done
        [ -z "$hit" ] && hit="$(ldconfig -p 2>/dev/null | awk -v l="$lib" '$1==l {print $NF; exit}')"
        echo "  $lib: ${hit:-NOT FOUND}"
    done
    [ -n "$PY" ] && "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>&1 | sed 's/^/  /'
} > "$ENV_LOG" 2>&1
cat "$ENV_LOG"

# --- run --------------------------------------------------------------------
# With BRAID_VALIDATE_PACK=1, pack what is under $OUT at the end, and also when
# an outer `timeout` stops the run (SIGTERM): the steps that finished keep
# their logs.
pack() {
    [ "${BRAID_VALIDATE_PACK:-0}" = 1 ] || return 0
    local tgz
    tgz="$(mktemp "${TMPDIR:-/tmp}/gpu-validate.XXXXXX.tgz")"
    if tar czf "$tgz" -C "$OUT" .; then
        find "$OUT" -mindepth 1 -delete
        mv "$tgz" "$OUT/gpu-validate.tgz"
    fi
}
trap 'echo "stopped by SIGTERM: $passed passed, $failed failed, $skipped skipped so far" | tee -a "$summary"; pack; exit 124' TERM
passed=0
failed=0
skipped=0
summary="$OUT/summary.txt"
: > "$summary"

run_one() { # kind path
    local kind="$1" bin="$2" name args log rc start end
    name="$(basename "$bin")"
    log="$OUT/logs/$name.log"
    if [ "$kind" = test ]; then
        # shellcheck disable=SC2206
        args=($TEST_ARGS)
    else
        args=()
        if [ -f "$bin.args" ]; then
            # shellcheck disable=SC2207
            args=($(cat "$bin.args"))
        fi
    fi
    echo "=== $name ${args[*]}"
    start=$(date +%s)
    timeout "$TIMEOUT" "$bin" "${args[@]}" < /dev/null > "$log" 2>&1
    rc=$?
    end=$(date +%s)
    tail -n 5 "$log" | sed 's/^/    /'
    if [ "$rc" -eq 0 ]; then
        passed=$((passed + 1))
        echo "PASS $name ($((end - start)) s)" | tee -a "$summary"
    else
        failed=$((failed + 1))
        [ "$rc" -eq 124 ] && echo "     (timed out after $TIMEOUT s)" | tee -a "$summary"
        echo "FAIL $name rc=$rc ($((end - start)) s), log: $log" | tee -a "$summary"
        grep -E '^(test .* FAILED|failures:|---- |thread .* panicked)' "$log" | head -n 40 | sed 's/^/    /' | tee -a "$summary"
    fi
}

is_exe() { [ -f "$1" ] && [ -x "$1" ] && case "$1" in *.args|*.d|*.rlib|*.so) false;; *) true;; esac; }

# The GPU's name, for BIN_DIR/needs.
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"

# BIN_DIR/needs: lines "NAME PATTERN"; program NAME runs only on a GPU whose
# name matches the extended regular expression PATTERN (case-insensitive),
# unless BRAID_VALIDATE_ALL=1. What a figure is worth only on one GPU kind
# (an issue's benchmark set on the H100 it names) then costs no device time
# on another.
needs_skip() { # name -> 0 (skip, says why) or 1 (run)
    local want
    [ "${BRAID_VALIDATE_ALL:-0}" = 1 ] && return 1
    [ -f "$BIN_DIR/needs" ] || return 1
    want="$(awk -v n="$1" '$1==n {$1=""; sub(/^ /, ""); print; exit}' "$BIN_DIR/needs")"
    [ -n "$want" ] || return 1
    grep -Eiq -- "$want" <<< "$GPU_NAME" && return 1
    skipped=$((skipped + 1))
    echo "SKIP $1 (needs a GPU matching '$want'; this one is '${GPU_NAME:-unknown}')" | tee -a "$summary"
    return 0
}

# BIN_DIR/order: program names, one a line, run first and in that order
# (most urgent first, so a session that runs out of time loses the least);
# the programs it does not name run after them, in name order.
programs() {
    local name
    if [ -f "$BIN_DIR/order" ]; then
        while read -r name; do
            [ -n "$name" ] && is_exe "$BIN_DIR/bin/$name" && echo "$BIN_DIR/bin/$name"
        done < "$BIN_DIR/order"
    fi
    for f in "$BIN_DIR"/bin/*; do
        is_exe "$f" || continue
        [ -f "$BIN_DIR/order" ] && grep -qxF -- "$(basename "$f")" "$BIN_DIR/order" && continue
        echo "$f"
    done
}

found=0
for f in "$BIN_DIR"/* "$BIN_DIR"/tests/*; do
    is_exe "$f" || continue
    found=1
    run_one test "$f"
done
while read -r f; do
    [ -n "$f" ] || continue
    found=1
    needs_skip "$(basename "$f")" && continue
    run_one bin "$f"
done < <(programs)
if [ "$found" -eq 0 ]; then
    echo "no executables found in $BIN_DIR" | tee -a "$summary"
    failed=$((failed + 1))
fi

echo "$passed passed, $failed failed, $skipped skipped" | tee -a "$summary"
pack
[ "$failed" -eq 0 ]
