#!/usr/bin/env bash
# Builds and tests Braid's C++ API (cpp/, ffi/, CMakeLists.txt), for CI:
#
#   1. configure, build and ctest            (build/cpp)
#   2. the same with ASan + UBSan             (build/cpp-sanitize, BRAID_SANITIZE=address,undefined,
#                                              leak detection on)
#   3. install, then build a consumer with find_package(Braid), one with
#      find_package(braid) and one with add_subdirectory(braid), and run them
#                                             (build/cpp-install, build/cpp-consumer-*)
#
# The Rust static library is built once by cargo (release profile, in
# $CARGO_TARGET_DIR when set, else the workspace's target/) and shared by every
# build directory, the add_subdirectory consumer's included. Exits non-zero on
# the first failure. Set BRAID_JOBS to change build parallelism (default 2).
#
# Needs cmake and a C++ compiler. Without cmake, when run as root on a system
# with apt-get (a CI container), it installs cmake itself (apt-get update,
# apt-get install -y cmake); otherwise it stops and says to install it.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
jobs="${BRAID_JOBS:-2}"

if ! command -v cmake >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing cmake"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake >/dev/null
  else
    echo "cpp-test: cmake is missing (apt-get install cmake)" >&2
    exit 1
  fi
fi
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then
  echo "cpp-test: no C++ compiler (apt-get install g++)" >&2
  exit 1
fi

start=$(date +%s)
step() { echo; echo "== $* ($(( $(date +%s) - start )) s)"; }

step "configure build/cpp"
cmake -S . -B build/cpp -DCMAKE_BUILD_TYPE=RelWithDebInfo
step "build build/cpp"
cmake --build build/cpp -j "$jobs"
step "ctest build/cpp"
ctest --test-dir build/cpp --output-on-failure --timeout 300

step "configure build/cpp-sanitize (address,undefined)"
cmake -S . -B build/cpp-sanitize -DCMAKE_BUILD_TYPE=Debug -DBRAID_SANITIZE=address,undefined
step "build build/cpp-sanitize"
cmake --build build/cpp-sanitize -j "$jobs"
step "ctest build/cpp-sanitize"
# The tests' ASAN_OPTIONS (detect_leaks=1, ...) are set by CMakeLists.txt.
ctest --test-dir build/cpp-sanitize --output-on-failure --timeout 600

step "install to build/cpp-install"
rm -rf build/cpp-install
cmake --install build/cpp --prefix "$root/build/cpp-install"

step "consumer via find_package(Braid)"
cmake -S cpp/consumer -B build/cpp-consumer-package -DBRAID_VIA=package \
  -DCMAKE_PREFIX_PATH="$root/build/cpp-install"
cmake --build build/cpp-consumer-package -j "$jobs"
build/cpp-consumer-package/braid_consumer

step "consumer via find_package(braid) (lowercase)"
cmake -S cpp/consumer -B build/cpp-consumer-lowercase -DBRAID_VIA=package -DBRAID_PACKAGE=braid \
  -DCMAKE_PREFIX_PATH="$root/build/cpp-install"
cmake --build build/cpp-consumer-lowercase -j "$jobs"
build/cpp-consumer-lowercase/braid_consumer

step "consumer via add_subdirectory(braid)"
cmake -S cpp/consumer -B build/cpp-consumer-subdir -DBRAID_VIA=subdirectory -DBRAID_SOURCE_DIR="$root"
cmake --build build/cpp-consumer-subdir -j "$jobs"
build/cpp-consumer-subdir/braid_consumer

step "cpp-test: all passed"
