#!/usr/bin/env bash
# The CMake package as another project uses it: builds the installed libraries
# (build/cmake-package, Ninja + ccache as tools/cmake_build.sh), `cmake --install`s them into
# build/cmake-install, checks that every installed header's includes are installed too, builds
# examples/consumer_cmake against the installation (find_package(Torch) +
# find_package(LibtorchFsdp CONFIG REQUIRED)) in build/consumer-cmake, and runs it on two
# processes (Gloo over a TCPStore on 127.0.0.1, torchrun's variables): FSDP2 training to
# parity with one rank. The last line is '1 passed, 0 failed' or '0 passed, 1 failed'.
#
#   tools/cmake_package_check.sh        (after ./x setup: needs third_party/torch_root)
#
# Environment: FSDP_CACHE_DIR (cache directory), FSDP_CMAKE_JOBS (build jobs, default 2),
# FSDP_CMAKE_NICE (the build's niceness, default 10). Exit status non-zero on any failure.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/build/cmake-package"
INSTALL="$ROOT/build/cmake-install"
CONSUMER="$ROOT/examples/consumer_cmake"
CONSUMER_BUILD="$ROOT/build/consumer-cmake"
JOBS="${FSDP_CMAKE_JOBS:-2}"
NICE="${FSDP_CMAKE_NICE:-10}"
WORLD=2
RUN_TIMEOUT=300  # seconds for the two-process run (it takes seconds; a hung rendezvous must end)

step() { printf '\n==> %s\n' "$*"; }
run() { printf '+ %s\n' "$*"; "$@"; }
die() { printf 'cmake_package_check: error: %s\n' "$*" >&2; echo "0 passed, 1 failed"; exit 1; }

for tool in cmake ninja python3; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool not found (Debian: apt-get install cmake ninja-build python3)"
done
TORCH_CMAKE="$(readlink -f "$ROOT/third_party/torch_root/share/cmake" 2>/dev/null || true)"
[ -n "$TORCH_CMAKE" ] && [ -f "$TORCH_CMAKE/Torch/TorchConfig.cmake" ] ||
  die "third_party/torch_root/share/cmake/Torch/TorchConfig.cmake missing: run ./x setup"
# CACHE, the ccache environment, UNITY and LAUNCHER, as tools/cmake_build.sh has them (so
# that ccache serves the same compiles).
source "$ROOT/tools/cmake_common.sh"
t0=$SECONDS

step "configure $BUILD (the installed libraries only: no tests)"
run cmake -S "$ROOT" -B "$BUILD" -G Ninja "${LAUNCHER[@]}" "${UNITY[@]}" -DFSDP_WITH_CUDA=OFF \
  -DFSDP_BUILD_TESTS=OFF -DFSDP_CHECK_BAZEL_PARITY=OFF -DFSDP_INSTALL=ON ||
  die "configuring the library failed (see above)"

step "build the package's libraries (--target fsdp_package, -j$JOBS, nice -n $NICE)"
t_build=$SECONDS
run nice -n "$NICE" cmake --build "$BUILD" -j "$JOBS" --target fsdp_package ||
  die "building the library failed (see above)"
build_s=$((SECONDS - t_build))

step "cmake --install into $INSTALL"
rm -rf "$INSTALL"
run cmake --install "$BUILD" --prefix "$INSTALL" >"$BUILD/install.log" ||
  { cat "$BUILD/install.log"; die "cmake --install failed"; }
echo "$(grep -c 'Installing:' "$BUILD/install.log") files; $(find "$INSTALL/include" -name '*.h' | wc -l) headers," \
  "$(find "$INSTALL/lib" -maxdepth 1 -name 'lib*' | wc -l) libraries"
ls "$INSTALL/lib/cmake/LibtorchFsdp"

step "the installed headers include only installed headers (of this repository)"
python3 - "$INSTALL/include" "$ROOT" <<'EOF' || die "an installed header includes a header that is not installed"
import os, re, sys
include, root = sys.argv[1], sys.argv[2]
missing = []
for dirpath, _, files in os.walk(include):
    for name in files:
        path = os.path.join(dirpath, name)
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', open(path).read(), re.M):
            # Quoted includes name this repository's headers by their path in it; others
            # (absl/...) come from the packages LibtorchFsdpConfig.cmake finds.
            if os.path.exists(os.path.join(root, inc)) and not os.path.exists(os.path.join(include, inc)):
                missing.append(f"{os.path.relpath(path, include)} includes {inc}")
print("\n".join(missing) or "ok")
sys.exit(1 if missing else 0)
EOF

step "configure $CONSUMER_BUILD: examples/consumer_cmake against the installation"
rm -rf "$CONSUMER_BUILD"  # found afresh: nothing cached from an earlier installation
run cmake -S "$CONSUMER" -B "$CONSUMER_BUILD" -G Ninja "${LAUNCHER[@]}" \
  -DCMAKE_PREFIX_PATH="$INSTALL;$TORCH_CMAKE" ||
  die "configuring examples/consumer_cmake against the installed package failed (see above)"
run nice -n "$NICE" cmake --build "$CONSUMER_BUILD" -j "$JOBS" ||
  die "building examples/consumer_cmake failed (see above)"

step "run: consumer_fsdp2 on $WORLD processes (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT)"
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
pids=()
for ((r = 0; r < WORLD; r++)); do
  RANK=$r WORLD_SIZE=$WORLD LOCAL_RANK=$r LOCAL_WORLD_SIZE=$WORLD MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
    timeout "$RUN_TIMEOUT" "$CONSUMER_BUILD/consumer_fsdp2" >"$CONSUMER_BUILD/rank$r.log" 2>&1 &
  pids+=($!)
done
ok=1
for r in "${!pids[@]}"; do
  wait "${pids[$r]}"
  rc=$?
  echo "--- rank $r (exit status $rc):"
  cat "$CONSUMER_BUILD/rank$r.log"
  if [ $rc -ne 0 ]; then
    echo "rank $r exited with $rc$([ $rc -eq 124 ] && echo " (timed out after ${RUN_TIMEOUT} s)")"
    ok=0
  elif ! grep -q ': PASS$' "$CONSUMER_BUILD/rank$r.log"; then
    echo "rank $r printed no PASS"
    ok=0
  fi
done

step "results (CMake package)"
echo "library build ${build_s} s; total $((SECONDS - t0)) s; installed in $INSTALL"
if [ $ok = 1 ]; then
  echo "PASS: examples/consumer_cmake (find_package(LibtorchFsdp)) trained FSDP2 on $WORLD processes to parity"
  echo "1 passed, 0 failed"
  exit 0
fi
echo "FAIL: examples/consumer_cmake on $WORLD processes (see above)"
echo "0 passed, 1 failed"
exit 1
