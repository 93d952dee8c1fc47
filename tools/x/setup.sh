# x setup: install what is missing (Debian packages, the build venv, the peer venv), write .bazelrc.user
#   Debian packages through apt-get only when one is missing; the build venv (the pinned torch
#   wheel, for LibTorch's headers and libraries) and the peer venv (PyTorch with its
#   dependencies and transformers, for the peer tests) in FSDP_CACHE_DIR; the links
#   third_party/torch_root (and cuda_root, torch_cuda_deps where nvcc is) and .bazelrc.user.
#   test, demo, check, bench and golden run it first.

x_setup() {
  [ $# -eq 0 ] || die "setup takes no arguments, got '$*'"
  cmd_setup
}

# What `./x test` and `./x demo` build with; `./x check` (CMake builds, libFuzzer) and `./x bench`
# (callgrind) add theirs as cmd_setup's arguments.
APT_PACKAGES=(bazel-bootstrap libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev libtomlplusplus-dev
  clang-format)

# setup_apt PACKAGE...: installs those of the Debian packages that are missing; the package
# manager is not called when none is.
setup_apt() {
  step "Debian packages: $*"
  local p missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then echo "all present"; return; fi
  echo "missing: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if ! $sudo apt-get update -q; then
    die "apt-get update failed: the Debian package registry is unreachable (needed for: ${missing[*]})"
  fi
  if ! DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    die "apt-get install ${missing[*]} failed (registry unreachable or package unknown)"
  fi
}

# pip_install PYTHON ARGS...: pip install into PYTHON's venv, through the cache. --no-compile:
# byte-compiling every module of torch, its CUDA wheels and transformers (~10k files) costs
# about a minute of CPU beside the compile; Python compiles what a peer imports on first use.
pip_install() {
  local python="$1"; shift
  PIP_CACHE_DIR="$CACHE/pip" "$python" -m pip install -q --no-compile "$@"
}

setup_venv() {
  step "Python venv with torch==$TORCH_VERSION at $VENV"
  if [ -x "$PY" ] && [ "$("$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as m
print(m.version("torch"))
EOF
)" = "$TORCH_VERSION" ]; then
    echo "present"
  else
    mkdir -p "$CACHE"
    [ -x "$PY" ] || python3 -m venv "$VENV" || die "python3 -m venv $VENV failed"
    # --no-deps: the C++ build needs only the wheel's headers and libtorch_cpu/c10; the
    # wheel's CUDA dependencies are gigabytes that a CPU build never loads.
    if ! pip_install "$PY" --no-deps "torch==$TORCH_VERSION"; then
      die "pip install torch==$TORCH_VERSION failed: PyPI unreachable or version not published"
    fi
  fi
  TORCH_DIR="$("$PY" - <<'EOF'
import importlib.util, os
spec = importlib.util.find_spec("torch")
print(os.path.dirname(spec.origin))
EOF
)"
  [ -f "$TORCH_DIR/lib/libtorch_cpu.so" ] || die "torch at $TORCH_DIR has no lib/libtorch_cpu.so"
}

setup_links() {
  step "Workspace links and .bazelrc.user"
  ln -sfn "$TORCH_DIR" third_party/torch_root
  echo "third_party/torch_root -> $TORCH_DIR"
  if command -v nvcc >/dev/null 2>&1; then
    local cuda_root
    cuda_root="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
    ln -sfn "$cuda_root" third_party/cuda_root
    echo "third_party/cuda_root -> $cuda_root"
  fi
  local nccl_code=""
  setup_torch_cuda_deps
  mkdir -p "$CACHE/bazel-disk"
  cat > .bazelrc.user <<EOF
# Written by ./x setup; machine-specific, git-ignored.
build --disk_cache=$CACHE/bazel-disk
build --linkopt=-Wl,-rpath,$TORCH_DIR/lib
build --define=CUDA_ROOT=$ROOT/third_party/cuda_root
build --define=TORCH_CUDA_DEPS=$ROOT/third_party/torch_cuda_deps
EOF
  # The NCCL version the pinned wheel requires: comm/nccl_process_group.cc checks that the
  # nccl.h it compiles against is that one (another one corrupts ProcessGroupNCCL's layout).
  [ -z "$nccl_code" ] || echo "build:cuda --define=FSDP_TORCH_NCCL_VERSION_CODE=$nccl_code" >> .bazelrc.user
  if [ -n "$PEER_PY" ]; then
    echo "test --test_env=FSDP_PEER_PYTHON=$PEER_PY" >> .bazelrc.user
    echo "peer python: $PEER_PY"
  fi
  echo "disk cache: $CACHE/bazel-disk"
}

# third_party/torch_cuda_deps -> the peer venv's site-packages/nvidia (the wheel's CUDA
# dependencies, NCCL among them), when nvcc is present and the peer venv has the NCCL version
# the pinned wheel requires; sets nccl_code (NCCL_VERSION_CODE of that version) for the caller.
setup_torch_cuda_deps() {
  rm -f third_party/torch_cuda_deps
  command -v nvcc >/dev/null 2>&1 || return 0
  local nvidia="" required have
  [ -z "$PEER_PY" ] ||
    nvidia="$("$PEER_PY" -c 'import os, nvidia; print(os.path.realpath(list(nvidia.__path__)[0]))' 2>/dev/null)"
  required="$("$PY" - "$TORCH_DIR" <<'PYEOF'
import glob, re, sys
for meta in glob.glob(sys.argv[1] + "/../torch-*.dist-info/METADATA"):
    for line in open(meta):
        m = re.match(r"Requires-Dist: nvidia-nccl-cu\d+==(\d+)\.(\d+)\.(\d+)", line)
        if m:
            major, minor, patch = map(int, m.groups())
            print(major * 10000 + minor * 100 + patch)
PYEOF
)"
  if [ -z "$nvidia" ] || [ ! -f "$nvidia/nccl/include/nccl.h" ] || [ -z "$required" ]; then
    echo "third_party/torch_cuda_deps: not made (needs the peer venv's nvidia/nccl and the wheel's NCCL pin); the CUDA build is skipped"
    return 0
  fi
  have="$(sed -n 's/^#define NCCL_VERSION_CODE \([0-9]*\).*/\1/p' "$nvidia/nccl/include/nccl.h")"
  if [ "$have" != "$required" ]; then
    echo "third_party/torch_cuda_deps: not made: $nvidia/nccl has NCCL_VERSION_CODE $have, the wheel needs $required"
    return 0
  fi
  ln -sfn "$nvidia" third_party/torch_cuda_deps
  nccl_code="$required"
  echo "third_party/torch_cuda_deps -> $nvidia (NCCL_VERSION_CODE $required)"
}

# PyTorch itself (with its CUDA-wheel dependencies, several GB) in a second venv, for the
# tests and benchmarks that compare against Python FSDP (bench/peer). Optional: without it
# those tests are reported as skipped, with the reason.
PEER_VENV="$CACHE/peer-venv-torch-$TORCH_VERSION"
PEER_PY=""
# The peer venv is missing (its probe fails): a fresh machine.
peer_venv_missing() {
  local probe='import torch, torch.distributed.fsdp; assert torch.__version__.split("+")[0] == "'"$TORCH_VERSION"'"'
  ! { [ -x "$PEER_VENV/bin/python" ] && "$PEER_VENV/bin/python" -c "$probe" 2>/dev/null; }
}

setup_peer_venv() {
  step "Python peer venv (PyTorch $TORCH_VERSION with dependencies) at $PEER_VENV"
  if ! peer_venv_missing; then
    echo "present"
  else
    [ -x "$PEER_VENV/bin/python" ] || python3 -m venv "$PEER_VENV" || { echo "warning: python3 -m venv failed; peer tests will be skipped"; return; }
    if ! pip_install "$PEER_VENV/bin/python" "torch==$TORCH_VERSION"; then
      echo "warning: pip install torch==$TORCH_VERSION (with dependencies) failed; peer tests will be skipped"
      return
    fi
    peer_venv_missing && { echo "warning: import torch fails in $PEER_VENV; peer tests will be skipped"; return; }
  fi
  PEER_PY="$PEER_VENV/bin/python"
  # Hugging Face transformers, the Llama reference of examples/llama (pinned: its modeling
  # code is what the parity test checks against). Optional: without it that test skips.
  local hf_version=5.24.0
  if ! "$PEER_PY" -c "import transformers; assert transformers.__version__ == '$hf_version'" 2>/dev/null; then
    pip_install "$PEER_PY" "transformers==$hf_version" ||
      echo "warning: pip install transformers==$hf_version failed; the Llama parity test will be skipped"
  fi
  # torchtitan and torchao (pinned), the references of the trainer (train/) and float8: their
  # own components write golden files (testing/golden/gen_train.py) and run in peer scripts.
  # torch stays pinned in the same install, so their requirements cannot move it. Optional:
  # without them `./x golden` stops at gen_train.py and those peer tests skip.
  local titan_version=0.3.0 ao_version=0.18.0
  if ! "$PEER_PY" -c "from importlib.metadata import version as v; assert (v('torchtitan'), v('torchao')) == ('$titan_version', '$ao_version')" 2>/dev/null; then
    pip_install "$PEER_PY" "torchtitan==$titan_version" "torchao==$ao_version" "torch==$TORCH_VERSION" ||
      echo "warning: pip install torchtitan==$titan_version torchao==$ao_version failed; the torchtitan comparisons will be skipped"
  fi
  # matplotlib (pinned), for the trainer's curves (tools/plot_metrics.py) and ./x bench --peer's
  # chart. Optional: without it those skip.
  local mpl_version=3.11.2
  if ! "$PEER_PY" -c "import matplotlib; assert matplotlib.__version__ == '$mpl_version'" 2>/dev/null; then
    pip_install "$PEER_PY" "matplotlib==$mpl_version" ||
      echo "warning: pip install matplotlib==$mpl_version failed; tools/plot_metrics.py's test will be skipped"
  fi
}

# cmd_setup [EXTRA_DEBIAN_PACKAGE...]
cmd_setup() {
  local t0=$SECONDS
  setup_apt "${APT_PACKAGES[@]}" "$@"
  setup_venv
  setup_peer_venv
  setup_links
  step "setup done in $((SECONDS - t0)) s"
}

# setup_begin: `./x test`'s and `./x demo`'s set-up. On a fresh machine (no peer venv) the
# peer venv (PyTorch with its CUDA dependencies, gigabytes to download and unpack; only the
# peer tests and the Llama demo need it) installs in the background (PEER_SETUP_PID) while
# the caller compiles and runs what needs only the build venv's LibTorch; setup_finish waits
# for it. Elsewhere this is cmd_setup.
PEER_SETUP_PID=""
setup_begin() {
  if ! peer_venv_missing; then cmd_setup; return; fi
  local t0=$SECONDS
  setup_apt "${APT_PACKAGES[@]}"
  setup_venv
  local log="$CACHE/peer-venv-setup.log"
  step "Python peer venv: installing in the background (log: $log) meanwhile"
  mkdir -p "$CACHE"
  # The subshell's PEER_PY reaches setup_finish through a file (probing again costs seconds).
  rm -f "$CACHE/peer-venv-setup.python"
  { setup_peer_venv; echo "$PEER_PY" > "$CACHE/peer-venv-setup.python"; } > "$log" 2>&1 &
  PEER_SETUP_PID=$!
  # Should ./x stop early (a failed build or demo), the install still completes: a pip left
  # running would meet the next ./x's own in the same venv.
  # shellcheck disable=SC2064  # $log now, the pid when it fires
  trap "[ -z \"\$PEER_SETUP_PID\" ] || { echo 'x: waiting for the peer venv install (log: $log)' >&2; wait \"\$PEER_SETUP_PID\"; }" EXIT
  setup_links
  step "set-up (without the peer venv) done in $((SECONDS - t0)) s"
}

# setup_finish: waits for setup_begin's background peer venv, then writes the links and
# .bazelrc.user again with the peer python. Only test-time settings change (--test_env, the
# CUDA config's NCCL define), so nothing compiled is rebuilt.
setup_finish() {
  [ -n "$PEER_SETUP_PID" ] || return 0
  local t0=$SECONDS
  step "waiting for the peer venv"
  wait "$PEER_SETUP_PID" || true
  PEER_SETUP_PID=""
  cat "$CACHE/peer-venv-setup.log"
  PEER_PY="$(cat "$CACHE/peer-venv-setup.python" 2>/dev/null || true)"
  [ -n "$PEER_PY" ] || setup_peer_venv
  setup_links
  step "peer venv ready after $((SECONDS - t0)) s of waiting"
}
