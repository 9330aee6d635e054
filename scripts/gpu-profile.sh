#!/usr/bin/env bash
# Profiles one run of a program with NVIDIA Nsight Systems and prints the
# time per CUDA kernel (`nsys stats`' cuda_gpu_kern_sum report), so a
# session on a lent GPU learns which kernels take the step's time, not only
# which tasks (the Chrome trace's spans). The report lands in $OUT (default
# ./gpu-profile-out) as KERNELS.txt with the .nsys-rep beside it.
#
# Usage:  scripts/gpu-profile.sh PROGRAM [ARGS...]
# Exit status: PROGRAM's, or 0 with a message when nsys is not installed.
set -uo pipefail
prog="${1:?usage: gpu-profile.sh PROGRAM [ARGS...]}"
shift
OUT="${OUT:-$PWD/gpu-profile-out}"
mkdir -p "$OUT"
nsys="$(command -v nsys || true)"
for d in /usr/local/cuda/bin /opt/nvidia/nsight-systems/*/bin /usr/local/cuda/nsight-systems-*/bin; do
    [ -z "$nsys" ] && [ -x "$d/nsys" ] && nsys="$d/nsys"
done
if [ -z "$nsys" ]; then
    echo "gpu-profile: nsys not found (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-systems)"
    exit 0
fi
name="$(basename "$prog")"
"$nsys" profile --trace=cuda --sample=none --cpuctxsw=none --force-overwrite=true \
    -o "$OUT/$name" "$prog" "$@" > "$OUT/$name.nsys.log" 2>&1
rc=$?
"$nsys" stats --report cuda_gpu_kern_sum --format table "$OUT/$name.nsys-rep" \
    > "$OUT/KERNELS.txt" 2>&1
head -45 "$OUT/KERNELS.txt"
exit $rc
