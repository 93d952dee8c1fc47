#!/usr/bin/env bash
# The CMake build (CMakeLists.txt + cmake/bazel_targets.cmake, generated from the BUILD files):
# configure with Ninja + ccache, build, run the tests with CTest, and print 'N passed, N failed'
# (GoogleTest cases, as for Bazel) as the last line. By default a smoke run
# (-DFSDP_CMAKE_SMOKE=ON): the libraries, the binaries (the demos) and one test per package,
# run with `ctest -L smoke` (the set: tools/gen_cmake_targets.py --smoke); `bazel test //...`
# is the full suite. --full (or FSDP_CMAKE_FULL=1) builds and runs every test.
# When nvcc and the wheel's NCCL (third_party/torch_cuda_deps) are present, also configures a second build with -DFSDP_WITH_CUDA=ON
# and builds the NCCL backend + nccl_test (compile and link check; there is no GPU here).
#
#   tools/cmake_build.sh [--full] [--no-check] [--build-only | --test-only]
#                                                 (after ./x setup: needs third_party/torch_root)
#
# --build-only: configure and build (and the CUDA compile check), no tests; --test-only: the
# tests and the summary of a tree an earlier --build-only built (its build log counts the
# targets that failed to build): the two phases let a caller overlap the build with other
# work. `./x check` runs both in one call.
# --no-check: configure with -DFSDP_CHECK_BAZEL_PARITY=OFF (./x test checks the generated
# target list itself, as a counted part). The build trees are in the checkout (build/cmake,
# build/cmake-cuda; git-ignored) and the ccache under the cache directory. ccache sees every
# path under the checkout relative to the build directory (CCACHE_BASEDIR), so a fresh clone
# in another directory hits the compiles of an earlier checkout, as Bazel's disk cache does.
# Environment: FSDP_CACHE_DIR (cache directory), FSDP_CMAKE_JOBS (build jobs, default 2),
# FSDP_CTEST_JOBS (tests run at once, default 2), FSDP_CMAKE_FULL=1 (as --full),
# FSDP_CMAKE_NICE (the build's niceness, default 10). Exit
# status non-zero when configuring, building or any test failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/build/cmake"
CUDA_BUILD="$ROOT/build/cmake-cuda"
JOBS="${FSDP_CMAKE_JOBS:-2}"
NICE="${FSDP_CMAKE_NICE:-10}"
CTEST_JOBS="${FSDP_CTEST_JOBS:-2}"

FULL="${FSDP_CMAKE_FULL:-0}"
CHECK=ON
BUILD_PHASE=1
TEST_PHASE=1
for arg in "$@"; do
  case "$arg" in
    --full) FULL=1 ;;
    --no-check) CHECK=OFF ;;
    --build-only) TEST_PHASE=0 ;;
    --test-only) BUILD_PHASE=0 ;;
    *) echo "usage: tools/cmake_build.sh [--full] [--no-check] [--build-only | --test-only]" >&2; exit 2 ;;
  esac
done
[ $BUILD_PHASE = 1 ] || [ $TEST_PHASE = 1 ] || { echo "cmake_build: --build-only and --test-only exclude each other" >&2; exit 2; }
[ "$FULL" = 1 ] && SMOKE=OFF || SMOKE=ON

step() { printf '\n==> %s\n' "$*"; }
run() { printf '+ %s\n' "$*"; "$@"; }
die() { printf 'cmake_build: error: %s\n' "$*" >&2; echo "0 passed, 1 failed"; exit 1; }

for tool in cmake ninja; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool not found (Debian: apt-get install cmake ninja-build)"
done
[ -f "$ROOT/third_party/torch_root/share/cmake/Torch/TorchConfig.cmake" ] ||
  die "third_party/torch_root/share/cmake/Torch/TorchConfig.cmake missing: run ./x setup"
# CACHE, the ccache environment, UNITY and LAUNCHER.
source "$ROOT/tools/cmake_common.sh"

rc=0
t0=$SECONDS
if [ "$SMOKE" = ON ]; then
  what="smoke: libraries, binaries, one test per package (--full: everything)"
  CTEST_SELECT=(-L smoke)
else
  what="full: every target and test"
  CTEST_SELECT=()
fi
BUILD_LOG="$BUILD/build.log"
# What the build phase leaves for the test phase: its notes and exit status.
BUILD_NOTES="$BUILD/build-notes.txt"
BUILD_STATUS="$BUILD/build-status.txt"

if [ $BUILD_PHASE = 1 ]; then
  rm -f "$BUILD_NOTES" "$BUILD_STATUS"
  mkdir -p "$BUILD"
  echo 1 > "$BUILD_STATUS"  # until the phase ends
  step "configure $BUILD ($what; Ninja${LAUNCHER:+, ccache in $CCACHE_DIR})"
  if ! run cmake -S "$ROOT" -B "$BUILD" -G Ninja "${LAUNCHER[@]}" "${UNITY[@]}" -DFSDP_WITH_CUDA=OFF \
       -DFSDP_BUILD_TESTS=ON -DFSDP_CMAKE_SMOKE=$SMOKE -DFSDP_CHECK_BAZEL_PARITY=$CHECK; then
    die "CMake configuration failed (see above)"
  fi

  step "build (-j$JOBS, nice -n $NICE; keeps going past errors so every test that can run does)"
  [ ${#LAUNCHER[@]} -eq 0 ] || ccache --zero-stats >/dev/null 2>&1
  t_build=$SECONDS
  run nice -n "$NICE" cmake --build "$BUILD" -j "$JOBS" -- -k 0 2>&1 | tee "$BUILD_LOG"
  if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    echo "BUILD FAILED (each target that failed to build counts as a failure below)"
    rc=1
  fi
  build_note="build: $((SECONDS - t_build)) s"
  if [ ${#LAUNCHER[@]} -gt 0 ]; then
    build_note+=", ccache: $(ccache --print-stats 2>/dev/null | awk -F'\t' '
      $1=="direct_cache_hit"||$1=="preprocessed_cache_hit"{h+=$2} $1=="cache_miss"{m+=$2}
      END{printf "%d hits, %d misses", h, m}')"
  fi

  # FSDP_WITH_CUDA: the NCCL backend (c10d's ProcessGroupNCCL) compiles and links against
  # libtorch_cuda.so, the CUDA runtime and the wheel's NCCL.
  cuda_note="cuda build: skipped (nvcc or third_party/torch_cuda_deps, the wheel's NCCL, not found)"
  NVCC="$(command -v nvcc 2>/dev/null || true)"
  [ -n "$NVCC" ] || { [ -x "$ROOT/third_party/cuda_root/bin/nvcc" ] && NVCC="$ROOT/third_party/cuda_root/bin/nvcc"; }
  if [ -n "$NVCC" ]; then
    CUDA_HOME_GUESS="$(dirname "$(dirname "$(readlink -f "$NVCC")")")"
    if [ -f "$ROOT/third_party/torch_cuda_deps/nccl/include/nccl.h" ]; then
      step "FSDP_WITH_CUDA=ON: configure $CUDA_BUILD, build comm_nccl + comm_nccl_test (compile + link only)"
      if run cmake -S "$ROOT" -B "$CUDA_BUILD" -G Ninja "${LAUNCHER[@]}" "${UNITY[@]}" -DFSDP_WITH_CUDA=ON \
           -DFSDP_BUILD_TESTS=ON -DFSDP_CHECK_BAZEL_PARITY=$CHECK -DCUDAToolkit_ROOT="$CUDA_HOME_GUESS" &&
         run nice -n "$NICE" cmake --build "$CUDA_BUILD" -j "$JOBS" --target comm_nccl comm_nccl_test; then
        cuda_note="cuda build: ok (comm_nccl + comm_nccl_test against $CUDA_HOME_GUESS)"
      else
        cuda_note="cuda build: FAILED (FSDP_WITH_CUDA=ON, see above)"
        rc=1
      fi
    fi
  fi
  printf '%s\n%s\n' "$build_note" "$cuda_note" > "$BUILD_NOTES"
  echo "$rc" > "$BUILD_STATUS"
  if [ $TEST_PHASE = 0 ]; then
    step "results (CMake build)"
    cat "$BUILD_NOTES"
    exit $rc
  fi
fi

# The test phase (after this run's or an earlier --build-only's build).
[ -f "$BUILD/build.ninja" ] && [ -f "$BUILD_STATUS" ] ||
  die "no CMake build in $BUILD to test (the build phase did not run or its configuration failed)"
[ "$(cat "$BUILD_STATUS")" = 0 ] || rc=1

step "ctest -j$CTEST_JOBS ${CTEST_SELECT[*]} --output-on-failure (per-test timeouts from the Bazel sizes: small 60 s, medium 300 s, large 900 s)"
CTEST_LOG="$BUILD/ctest.log"
rm -rf "$BUILD/test-xml"   # each test writes its GoogleTest XML there (GTEST_OUTPUT)
t_test=$SECONDS
(cd "$BUILD" && run ctest -j "$CTEST_JOBS" "${CTEST_SELECT[@]}" --output-on-failure --timeout 900) 2>&1 | tee "$CTEST_LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
test_note="tests: $((SECONDS - t_test)) s"

step "results (CMake)"
notes="$(cat "$BUILD_NOTES" 2>/dev/null)"
echo "$what; ${notes%%$'\n'*}; $test_note; total $((SECONDS - t0)) s"
echo "${notes#*$'\n'}"
# Test cases from each test's GoogleTest XML, as for Bazel (a crashed test counts as one
# failure); the last line is 'N passed, N failed'.
summary="$(python3 "$ROOT/tools/test_summary.py" --ctest "$CTEST_LOG" "$BUILD/test-xml" "$BUILD_LOG")" || rc=1
printf '%s\n' "$summary"
exit $rc
