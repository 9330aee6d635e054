#!/usr/bin/env bash
# Checks, with no GPU, that every cuDNN attention graph Braid builds
# (braid-cuda's `cudnn::graph`: the unified, band and composite forward and
# backward graphs) is accepted by a real cuDNN: every tensor, operation and
# operation-graph descriptor finalizes. Whether an engine takes the graph
# needs a GPU (models/gpt2/tests/cuda_cudnn.rs).
#
# Usage:  scripts/cudnn-graph-check.sh [TARGET_DIR]   (default target/cudnn-9.28)
#
# cuDNN comes from NVIDIA's nvidia-cudnn-cu13 wheel (pinned: BRAID_CUDNN_VERSION),
# of which only the libraries descriptor building loads are kept. One of
# them (the runtime-compiled engines) links against the driver, libcuda.so.1,
# which a machine without a GPU lacks, and cuDNN refuses every descriptor when
# a sub-library fails to load. So the check puts a stand-in libcuda.so.1 on the
# library path of this one test only: the six driver functions that library
# imports, each failing with CUDA_ERROR_NO_DEVICE (100). Nothing here runs a
# kernel or calls the stand-in.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VERSION="${BRAID_CUDNN_VERSION:-9.28.1.4}"
TARGET="${1:-target/cudnn-${VERSION%.*.*}}"
mkdir -p "$TARGET"
TARGET="$(cd "$TARGET" && pwd)"
LIB="$TARGET/lib"
STUB="$TARGET/no-driver"
KEEP="libcudnn.so.9 libcudnn_graph.so.9 libcudnn_heuristic.so.9 \
libcudnn_engines_precompiled.so.9 libcudnn_engines_runtime_compiled.so.9 libcudnn_engines_tensor_ir.so.9"

if [ ! -e "$LIB/.complete" ]; then
    PYTHON="${PYTHON:-$(command -v python3 || command -v python || true)}"
    if [ -z "$PYTHON" ]; then
        echo "cudnn-graph-check: no python3 or python found (pip downloads cuDNN); set PYTHON" >&2
        exit 1
    fi
    dl="$(mktemp -d "${TMPDIR:-/tmp}/braid-cudnn.XXXXXX")"
    trap 'rm -rf "$dl"' EXIT
    echo "cudnn-graph-check: downloading nvidia-cudnn-cu13==$VERSION" >&2
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
        --dest "$dl" "nvidia-cudnn-cu13==$VERSION" >&2
    mkdir -p "$LIB"
    for f in $KEEP; do
        "$PYTHON" - "$dl"/*.whl "$f" "$LIB" <<'PYEOF'
import sys, zipfile, shutil, os
wheel, name, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    # An older release may lack a library (tensor_ir is new in 9.2x).
    for member in (m for m in z.namelist() if m.endswith("/lib/" + name)):
        with z.open(member) as src, open(os.path.join(out, name), "wb") as dst:
            shutil.copyfileobj(src, dst)
PYEOF
    done
    rm -rf "$dl"
    trap - EXIT
    touch "$LIB/.complete"
fi
# cudarc opens "libcudnn.so" first.
ln -sf libcudnn.so.9 "$LIB/libcudnn.so"

mkdir -p "$STUB"
cat > "$STUB/no-driver.c" <<'CEOF'
/* The driver functions libcudnn_engines_runtime_compiled.so.9 imports, each
 * failing with CUDA_ERROR_NO_DEVICE: enough for the library to load. */
int cuGetErrorString(int e, const char **s) { (void)e; if (s) *s = "no device"; return 100; }
int cuModuleGetFunction(void *f, void *m, const char *n) { (void)f; (void)m; (void)n; return 100; }
int cuModuleLoadData(void *m, const void *image) { (void)m; (void)image; return 100; }
int cuModuleUnload(void *m) { (void)m; return 100; }
int cuTensorMapEncodeIm2col(void) { return 100; }
int cuTensorMapEncodeTiled(void) { return 100; }
CEOF
cc -shared -fPIC -o "$STUB/libcuda.so.1" "$STUB/no-driver.c"

# A filter that matches no test would pass: count the tests that ran.
log="$TARGET/test.log"
BRAID_REQUIRE_CUDNN=1 LD_LIBRARY_PATH="$LIB:$STUB" \
    cargo test -p braid-cuda --lib cudnn::graph -- --nocapture 2>&1 | tee "$log"
passed="$(sed -n 's/^test result: .* \([0-9][0-9]*\) passed;.*/\1/p' "$log" | awk '{n += $1} END {print n + 0}')"
if [ "$passed" -eq 0 ]; then
    echo "cudnn-graph-check: no test ran (does the filter cudnn::graph still match braid-cuda's tests?)" >&2
    exit 1
fi
echo "cudnn-graph-check: $passed tests passed" >&2
