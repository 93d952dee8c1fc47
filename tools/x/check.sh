# x check: set up, then what CI runs after test: CMake + consumer builds, the CUDA link, ASan/UBSan, TSan, fuzz
#   bazel build //... and the headers_alone tests; the CUDA compile-and-link where nvcc and the
#   wheel's NCCL are; the consumer Bazel workspace; the CMake build with its tests, its mirror
#   of the BUILD files and the installed package; the suite under ASan + UBSan; TSan on the
#   concurrent suites; libFuzzer. Each a counted part; the last line sums them.

x_check() { cmd_check "$@"; }

# The CMake builds and libFuzzer's, as cmd_setup's extra Debian packages.
APT_CHECK_PACKAGES=(cmake ninja-build ccache clang libclang-rt-14-dev)

# What CI runs after `./x test`, each a counted part:
# - the other ways to build the project: the CMake build (tools/cmake_build.sh: the libraries,
#   the demos and one test per package under CTest) and its mirror of the BUILD files
#   (cmake/check_bazel_parity.py); the installed CMake package used by an outside project
#   (tools/cmake_package_check.sh: find_package(LibtorchFsdp), two ranks to parity); the
#   separate Bazel workspace examples/consumer_bazel; the CUDA path compiled and linked
#   (--config=cuda) where the CUDA toolkit and the wheel's NCCL are;
# - ASan + UBSan over the whole CPU suite, in a separate Bazel output base (sanitized objects
#   would otherwise replace the normal ones and force rebuilds); the disk cache is shared, so a
#   second run reuses compiles. --symlink_prefix=/: no bazel-* links into that output base
#   (links into a foreign output base would make the default server's //... descend into
#   them). LibTorch itself is not instrumented: leaks and new/delete pairing inside it are not
#   ours to judge (detect_leaks=0, alloc_dealloc_mismatch=0);
# - TSan on the communication layer, the threaded runner and FSDP2; libFuzzer.
# Every package with tests is in one of the two lists (tools/x/check_test.py checks it, so a new
# package cannot be left out by accident). Not under the sanitizers: examples/, whose tests
# start the demo programs and torchrun as processes over library code that the packages' own
# tests already run here.
CHECK_TARGETS=(//pickle/... //checkpoint/... //dcp/... //env/... //comm/... //device/... //mesh/... //dtensor/... //fsdp/... //optim_state/... //metrics/... //tensor_parallel/... //pipelining/... //float8/... //context_parallel/... //models/... //train/... //testing/... //tests/... //tools/... //fuzz/...)
# shellcheck disable=SC2034  # read by tools/x/check_test.py, not by ./x
CHECK_UNSANITIZED=(//examples/...)
# Not conformance_test: its Gloo-heavy runs crash TSan's own deadlock detector inside c10d.
TSAN_TARGETS=(//comm:comm_test //mesh:device_mesh_test //fsdp/fsdp2:fsdp2_test)
# reset_runfiles_if_moved OUTPUT_BASE: the check's output bases are shared by every checkout,
# and Bazel's runfiles manifests do not depend on the checkout's path: a test's runfiles would
# still link into the checkout that last built them (its data files missing or stale). When the
# checkout changed, drop the manifests and trees; Bazel rebuilds them in seconds.
reset_runfiles_if_moved() {
  local base="$1" stamp="$1/fsdp_checkout"
  if [ -d "$base/execroot" ] && [ "$(cat "$stamp" 2>/dev/null)" != "$ROOT" ]; then
    find "$base/execroot" -path '*/bazel-out/*' \( -name '*.runfiles_manifest' -o -name '*.runfiles' \) \
      -prune -exec rm -rf {} + 2>/dev/null || true
  fi
  mkdir -p "$base" && echo "$ROOT" > "$stamp"
}

cmd_check() {
  [ $# -eq 0 ] || die "check takes no arguments, got '$*'"
  times_begin check
  local t_cmd=$SECONDS t0=$SECONDS
  cmd_setup "${APT_CHECK_PACKAGES[@]}"
  lap set-up
  mkdir -p "$ROOT/build"
  local rc=0 times="" parts=()
  check_builds || rc=1
  lap "" builds
  local base="$CACHE/bazel-check-output" log="$ROOT/bazel-check.log"
  reset_runfiles_if_moved "$base"
  step "ASan + UBSan: bazel test ${CHECK_TARGETS[*]}"
  # Not the headers_alone tests (tools/cc.bzl): compiling each public header alone under the
  # sanitizers' flags checks nothing the normal build did not.
  bazel --output_base="$base" test --config=asan --config=ubsan --keep_going --symlink_prefix=/ \
    --build_tag_filters=-headers_alone --test_tag_filters=-headers_alone \
    --test_env=ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0 \
    --test_env=UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "${CHECK_TARGETS[@]}" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
  step "results (ASan + UBSan)"
  python3 tools/test_summary.py "$log" "$(bazel --output_base="$base" info --config=asan --config=ubsan bazel-testlogs 2>/dev/null)" |
    tee "$ROOT/build/check-asan.txt" || rc=1
  lap asan+ubsan asan+ubsan
  # LibTorch is uninstrumented: tools/tsan_suppressions.txt lists, with reasons, what that
  # hides. Built without the precompiled LibTorch header (tools/cc.bzl), so a TU that misses
  # an #include fails here.
  local tbase="$CACHE/bazel-tsan-output" tlog="$ROOT/bazel-check-tsan.log"
  reset_runfiles_if_moved "$tbase"
  step "TSan: bazel test ${TSAN_TARGETS[*]}"
  bazel --output_base="$tbase" test --config=tsan --define=torch_pch=off --keep_going --symlink_prefix=/ \
    --test_env=TSAN_OPTIONS="suppressions=$ROOT/tools/tsan_suppressions.txt:report_signal_unsafe=0" \
    "${TSAN_TARGETS[@]}" 2>&1 | tee "$tlog" || rc=${PIPESTATUS[0]}
  step "results (TSan)"
  python3 tools/test_summary.py "$tlog" "$(bazel --output_base="$tbase" info --config=tsan bazel-testlogs 2>/dev/null)" |
    tee "$ROOT/build/check-tsan.txt" || rc=1
  lap tsan tsan
  # Untrusted files: libFuzzer on the checkpoint, optimizer-state and torchrun-env loaders.
  step "libFuzzer (clang, ASan + UBSan): tools/fuzz.sh, 60 s per target"
  tools/fuzz.sh 2>&1 | tee "$ROOT/build/check-fuzz.txt" || rc=1
  lap fuzz fuzz
  times_add total $((SECONDS - t_cmd))
  step "results (builds, ASan + UBSan, TSan, libFuzzer; times: $times)"
  python3 tools/test_summary.py --combine "${CHECK_BUILD_PARTS[@]}" asan+ubsan="$ROOT/build/check-asan.txt" \
    tsan="$ROOT/build/check-tsan.txt" fuzz="$ROOT/build/check-fuzz.txt" || rc=1
  return "$rc"
}

# check_builds: the CUDA link, the consumer workspace, the CMake build and its tests, the
# CMake parity, the installed package; sets CHECK_BUILD_PARTS (NAME=FILE for --combine).
CHECK_BUILD_PARTS=()
check_builds() {
  local rc=0 cuda="$ROOT/build/check-cuda-build.txt" all="$ROOT/build/check-build-all.txt" t0=$SECONDS
  step "bazel build //... (also what ./x test leaves out: benchmarks, fuzzers, tools, demos)"
  delete_stale_bazel_links
  count_check "$all" bazel build --keep_going //... || rc=1
  CHECK_BUILD_PARTS+=(build-all="$all")
  lap build-all
  # The build above compiled each public header alone; these tests read the verdicts.
  local alone="$ROOT/build/check-headers-alone.txt"
  bazel_test_part "every public header compiled on its own" "$ROOT/bazel-check-headers-alone.log" "$alone" \
    --test_tag_filters=headers_alone //... || rc=1
  CHECK_BUILD_PARTS+=(headers-alone="$alone")
  lap headers-alone
  if command -v nvcc >/dev/null 2>&1 && [ -f third_party/torch_cuda_deps/nccl/include/nccl.h ]; then
    # The code with CUDA-only parts (//comm, //device, the multi-rank runner's NCCL processes in
    # //testing:multi_rank, built with //comm/...) compiles and links against libtorch_cuda.so;
    # the NCCL and stream tests run (without a GPU: the option checks and the device-missing
    # error, which load libtorch_cuda.so; the GPU cases report skipped with the reason). The
    # FSDP libraries have no CUDA-only code; tools/gpu_check.sh builds everything on GPU hosts.
    step "bazel test --config=cuda //comm:nccl_test //device:stream_test (and build //comm/... //device/...)"
    local cuda_log="$ROOT/bazel-test-cuda.log"
    if bazel build --config=cuda //comm/... //device/... &&
       bazel test --config=cuda //comm:nccl_test //device:stream_test 2>&1 | tee "$cuda_log"; then
      python3 tools/test_summary.py "$cuda_log" "$(bazel info --config=cuda bazel-testlogs 2>/dev/null)" > "$cuda" ||
        rc=1
    else printf 'cuda build or tests: FAILED\n0 passed, 1 failed\n' > "$cuda"; rc=1; fi
    cat "$cuda"
    CHECK_BUILD_PARTS+=(cuda="$cuda")
    lap cuda
  else
    echo "cuda build: skipped (nvcc or third_party/torch_cuda_deps, the wheel's NCCL, not found)"
  fi
  step "consumer workspace: tools/consumer_bazel.sh"
  tools/consumer_bazel.sh 2>&1 | tee "$ROOT/build/check-consumer.txt" || rc=1
  lap consumer
  step "CMake build and its tests: tools/cmake_build.sh --no-check"
  tools/cmake_build.sh --no-check 2>&1 | tee "$ROOT/build/check-cmake.txt" || rc=1
  lap cmake
  # The CMake configuration mirrors the BUILD files (the self-check a plain `cmake -S . -B
  # build` runs at configure time, FSDP_CHECK_BAZEL_PARITY, which --no-check turned off): its
  # manifest against cmake/bazel_build_files.py's reading of them.
  local parity="$ROOT/build/check-cmake-parity.txt"
  step "CMake mirrors the BUILD files: python3 cmake/check_bazel_parity.py . build/cmake/bazel_parity_manifest.txt"
  count_check "$parity" python3 cmake/check_bazel_parity.py "$ROOT" "$ROOT/build/cmake/bazel_parity_manifest.txt" || rc=1
  lap cmake-parity
  step "the installed CMake package from an outside project: tools/cmake_package_check.sh"
  tools/cmake_package_check.sh 2>&1 | tee "$ROOT/build/check-cmake-package.txt" || rc=1
  lap cmake-package
  CHECK_BUILD_PARTS+=(consumer="$ROOT/build/check-consumer.txt" cmake="$ROOT/build/check-cmake.txt"
                      cmake-parity="$parity" cmake-package="$ROOT/build/check-cmake-package.txt")
  return "$rc"
}
