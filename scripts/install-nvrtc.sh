#!/usr/bin/env bash
# Installs NVRTC (the CUDA runtime compiler) from NVIDIA's pip wheel, pinned to the
# CUDA 13.0 series, so that `.cu` kernels can be compile-checked on a machine with
# no GPU and no CUDA toolkit (CI). Nothing here needs a GPU or a driver.
#
# Usage:
#   NVRTC_LIB_DIR="$(scripts/install-nvrtc.sh [TARGET_DIR])"
#   export LD_LIBRARY_PATH="$NVRTC_LIB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
#
# TARGET_DIR defaults to $BRAID_NVRTC_DIR, else ~/.cache/braid/nvrtc-13.0.
# The install is skipped when libnvrtc.so.13 is already there (idempotent).
# Only the directory holding libnvrtc.so.13 is printed on stdout; pip's chatter
# goes to stderr.
set -euo pipefail

VERSION_SPEC="${BRAID_NVRTC_VERSION:-13.0.*}"
TARGET="${1:-${BRAID_NVRTC_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/braid/nvrtc-13.0}}"

find_lib_dir() {
    # The CUDA 13 wheels put libraries under nvidia/cu13/lib; the CUDA 12 ones
    # under nvidia/cuda_nvrtc/lib. Search rather than guess.
    local f
    f="$(find "$TARGET" -name 'libnvrtc.so.13*' -not -name '*builtins*' 2>/dev/null | sort | head -n 1 || true)"
    [ -n "$f" ] && dirname "$f"
}

dir="$(find_lib_dir || true)"
if [ -z "$dir" ]; then
    PYTHON="${PYTHON:-$(command -v python3 || command -v python || true)}"
    if [ -z "$PYTHON" ]; then
        echo "install-nvrtc: no python3 or python found (pip is needed to install NVRTC); set PYTHON" >&2
        exit 1
    fi
    mkdir -p "$TARGET"
    echo "install-nvrtc: pip installing nvidia-cuda-nvrtc==$VERSION_SPEC into $TARGET" >&2
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps \
        --target "$TARGET" "nvidia-cuda-nvrtc==$VERSION_SPEC" >&2
    dir="$(find_lib_dir || true)"
fi

if [ -z "$dir" ]; then
    echo "install-nvrtc: libnvrtc.so.13 not found under $TARGET after install" >&2
    exit 1
fi
# cudarc looks for "libnvrtc.so.13" by name through the dynamic loader.
echo "$dir"
