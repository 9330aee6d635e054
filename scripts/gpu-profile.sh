#!/usr/bin/env bash
# Profiles one run of a program with NVIDIA's profilers, so a session on a
# lent GPU learns which kernels take the step's time and why, not only which
# tasks (the Chrome trace's spans). Output lands in $OUT (default
# ./gpu-profile-out):
#   - with Nsight Systems (nsys): KERNELS.txt, the time per CUDA kernel
#     (`nsys stats`' cuda_gpu_kern_sum), and the .nsys-rep;
#   - else with Nsight Compute (ncu; run 6's machine had only this):
#     NCU.txt, speed of light, occupancy and warp-state sections for the
#     first BRAID_NCU_COUNT (default 4) launches of the kernels matching
#     BRAID_NCU_KERNELS (a regex, default the tensor-core attention and the
#     fused classifier).
#
# Usage:  scripts/gpu-profile.sh PROGRAM [ARGS...]
# Exit status: the profiled PROGRAM's, or 0 with a message when neither
# profiler is installed.
set -uo pipefail
prog="${1:?usage: gpu-profile.sh PROGRAM [ARGS...]}"
shift
OUT="${OUT:-$PWD/gpu-profile-out}"
mkdir -p "$OUT"
find_tool() { # name: its path on PATH or under NVIDIA's usual directories
    local hit
    hit="$(command -v "$1" || true)"
    for d in /usr/local/cuda/bin /opt/nvidia/nsight-systems/*/bin /opt/nvidia/nsight-compute/*; do
        [ -z "$hit" ] && [ -x "$d/$1" ] && hit="$d/$1"
    done
    echo "$hit"
}
name="$(basename "$prog")"
nsys="$(find_tool nsys)"
ncu="$(find_tool ncu)"
if [ -n "$nsys" ]; then
    "$nsys" profile --trace=cuda --sample=none --cpuctxsw=none --force-overwrite=true \
        -o "$OUT/$name" "$prog" "$@" > "$OUT/$name.nsys.log" 2>&1
    rc=$?
    "$nsys" stats --report cuda_gpu_kern_sum --format table "$OUT/$name.nsys-rep" \
        > "$OUT/KERNELS.txt" 2>&1
    head -45 "$OUT/KERNELS.txt"
    exit $rc
elif [ -n "$ncu" ]; then
    "$ncu" --kernel-name "regex:${BRAID_NCU_KERNELS:-flash_attention_tc|fused_classifier}" \
        --launch-count "${BRAID_NCU_COUNT:-4}" \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        "$prog" "$@" > "$OUT/NCU.txt" 2>&1
    rc=$?
    grep -E "^  [a-z_0-9]+ \(|Duration|Throughput|Occupancy|Warp Cycles|Block Limit" "$OUT/NCU.txt" | head -60
    exit $rc
fi
echo "gpu-profile: neither nsys nor ncu found (PATH, /usr/local/cuda/bin, /opt/nvidia)"
exit 0
