#!/usr/bin/env bash
# The GPU checks of the engines issue, as one prepared script for a lent GPU machine (the
# `device` tool: a bare machine with CUDA, CMake, ninja and a python3 holding some PyTorch,
# no Bazel, no Debian packages of ours, no network, a 10-minute limit per command).
#
#   here (with network):  tools/gpu_check.sh --fetch-deps   # Debian .debs into .gpu-deps/
#   on the GPU machine:    tools/gpu_check.sh               # carry: [".gpu-deps"]
#
# On the GPU machine it unpacks the carried .debs (abseil, GoogleTest, Google Benchmark, gloo
# headers) under /opt/fsdp-deps and builds with CMake against that machine's PyTorch
# (-DFSDP_WITH_CUDA=ON, its nvidia/ NCCL). Then it runs:
# - NcclTest.*: one-rank group, CUDA collectives, ProcessGroupNCCL's watchdog on a stuck
#   collective;
# - Nccl/*: the comm conformance suite, W up to the visible GPUs;
# - *nccl_processes*: FSDP2 and FSDP1 parity on CUDA vs one rank;
# - RingAttention.Cuda*: context parallelism's ring over ATen's CUDA attention kernels;
# - Stager.Cuda*: async checkpoint staging of CUDA parameters into pinned buffers on a side
#   stream (torchtitan's async_with_pinned_mem);
# - TrainerDevice.*: the trainer on cuda:0 (one rank; two pipeline stages) against the CPU;
#   then `train` on the debugmodel config in bfloat16 on one GPU (torchtitan's log line:
#   tokens/s, MFU);
# - the demo on CUDA under torchrun, one rank per GPU;
# - bench/e2e side by side with PyTorch's FSDP2 on the same GPUs: step times, and one profiled
#   step of each as a Chrome trace (does the all-gather overlap compute?).
# Output: everything printed goes to $OUT/gpu_check.log; the rest (GoogleTest XML, the demo's
# and the benchmarks' output) to $OUT/results.tgz; the compute model's two traces to
# $OUT/{ours,pytorch}.rank0.json (the tool brings back at most 8 files). The last line is
# 'N passed, N failed, N skipped'.
#
# Options: --jobs N (default: all cores), --build DIR (default build/gpu), --nccl-only (build and
# run only comm/nccl_test: a short rerun when little device time is left).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEPS_DIR="$ROOT/.gpu-deps"
# Debian 12 names (what `./x setup` installs here); their headers and CMake configs are all
# the CMake build needs besides CUDA and PyTorch.
DEBS=(libabsl-dev libabsl20220623 libgtest-dev libgmock-dev libgloo-dev libbenchmark-dev libbenchmark1debian
  libtomlplusplus-dev libtomlplusplus3)

if [ "${1:-}" = "--fetch-deps" ]; then
  mkdir -p "$DEPS_DIR" && cd "$DEPS_DIR" || exit 1
  apt-get download "${DEBS[@]}" || { echo "apt-get download failed (needs the Debian registry)"; exit 1; }
  du -sh "$DEPS_DIR"
  exit 0
fi

JOBS="$(nproc)"
NCCL_ONLY=0
BUILD="$ROOT/build/gpu"
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) JOBS="$2"; shift 2 ;;
    --nccl-only) NCCL_ONLY=1; shift ;;
    --build) BUILD="$2"; shift 2 ;;
    *) echo "unknown argument: $1"; exit 2 ;;
  esac
done
OUT="${OUT:-$ROOT/build/gpu-out}"
RESULTS="$BUILD-results"
mkdir -p "$OUT" && rm -rf "$RESULTS" && mkdir -p "$RESULTS"
exec > >(tee "$OUT/gpu_check.log") 2>&1
step() { printf '\n==> %s\n' "$*"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed"
date -u
PY="${PYTHON:-python3}"
TORCH_DIR="$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" ||
  { echo "no PyTorch in $PY"; exit 1; }
NVIDIA_DIR="$("$PY" -c 'import os, nvidia; print(os.path.realpath(list(nvidia.__path__)[0]))' 2>/dev/null)"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
echo "torch: $TORCH_DIR; nvidia: ${NVIDIA_DIR:-none}"
NVCC="$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)"
[ -n "$NVCC" ] || { echo "no nvcc"; exit 1; }
[ -f "$NVIDIA_DIR/nccl/include/nccl.h" ] || { echo "no nvidia/nccl/include/nccl.h beside torch"; exit 1; }

step "dependencies from .gpu-deps"
PREFIX=/opt/fsdp-deps
if ls "$DEPS_DIR"/*.deb >/dev/null 2>&1; then
  mkdir -p "$PREFIX"
  for f in "$DEPS_DIR"/*.deb; do dpkg -x "$f" "$PREFIX" || echo "dpkg -x $f failed"; done
else
  echo "no .gpu-deps/*.deb (run tools/gpu_check.sh --fetch-deps where the registry is reachable, carry .gpu-deps)"
fi
export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

step "configure and build (CMake, FSDP_WITH_CUDA=ON, $JOBS jobs)"
ln -sfn "$TORCH_DIR" "$ROOT/third_party/torch_root"
ln -sfn "$NVIDIA_DIR" "$ROOT/third_party/torch_cuda_deps"
CUDA_HOME_GUESS="$(dirname "$(dirname "$(readlink -f "$NVCC")")")"
ln -sfn "$CUDA_HOME_GUESS" "$ROOT/third_party/cuda_root"
TARGETS=(comm_nccl_test comm_conformance_test fsdp2_fsdp2_test fsdp1_fsdp1_test
         context_parallel_ring_attention_test dcp_dcp_test train_train_test train examples_fsdp2_demo
         bench_e2e_bench)
[ "$NCCL_ONLY" = 1 ] && TARGETS=(comm_nccl_test)
LAUNCHER=()
! command -v ccache >/dev/null 2>&1 || LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
t0=$SECONDS
if ! cmake -S "$ROOT" -B "$BUILD" -G Ninja "${LAUNCHER[@]}" -DFSDP_WITH_CUDA=ON -DFSDP_BUILD_TESTS=ON \
     -DFSDP_BUILD_BENCH=ON -DFSDP_CHECK_BAZEL_PARITY=OFF -DCUDAToolkit_ROOT="$CUDA_HOME_GUESS" \
     -DCMAKE_PREFIX_PATH="$PREFIX/usr;$PREFIX/usr/lib/x86_64-linux-gnu/cmake" \
     -DCMAKE_CXX_FLAGS="-isystem $PREFIX/usr/include" ||
   ! cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}"; then
  echo "build failed after $((SECONDS - t0)) s"
  echo "0 passed, 1 failed, 0 skipped"
  exit 1
fi
echo "built in $((SECONDS - t0)) s"

step "GPU cases"
rc=0
run_case() {  # name binary filter
  local name="$1" bin="$2" filter="$3" t=$SECONDS
  echo "--- $name: $bin --gtest_filter=$filter"
  "$BUILD/bin/$bin" --gtest_filter="$filter" --gtest_output="xml:$RESULTS/$name.xml"
  local status=$?
  echo "--- $name: $((SECONDS - t)) s, exit status $status"
  [ "$status" -eq 0 ] && return
  rc=1
  # A binary that dies (std::terminate in a destructor, a signal) may leave no XML, or one
  # without the failure: count the death itself, so the summary line cannot say 0 failed.
  if ! grep -q '<failure' "$RESULTS/$name.xml" 2>/dev/null; then
    printf '<testsuites><testsuite name="%s"><testcase classname="Exit" name="%s"><failure message="%s exited with status %s"/></testcase></testsuite></testsuites>\n' \
      "$name" "$name" "$bin" "$status" > "$RESULTS/$name-exit.xml"
  fi
}
run_case nccl comm/nccl_test 'NcclTest.*'
if [ "$NCCL_ONLY" != 1 ]; then
run_case conformance comm/conformance_test 'Nccl/*'
run_case fsdp2_parity fsdp/fsdp2/fsdp2_test '*nccl_processes*'
run_case fsdp1_parity fsdp/fsdp1/fsdp1_test 'Fsdp1/ParityTest.*nccl_processes*'
run_case ring_attention context_parallel/ring_attention_test 'RingAttention.Cuda*'
run_case async_staging dcp/dcp_test 'Stager.Cuda*'
run_case trainer train/train_test 'TrainerDevice.*'
echo "--- train: the debugmodel config on cuda:0 in bfloat16, 30 steps (torchtitan's log line: tps, mfu)"
t=$SECONDS
if (cd "$ROOT" && "$BUILD/bin/train/train" --config train/configs/debugmodel.toml --training.steps=30 \
      --training.mixed_precision_param=bfloat16 --metrics.log_freq=5 --validator.enable=false \
      --dump_folder="$RESULTS/train") > "$RESULTS/train.txt" 2>&1 && grep -q '^step: 30' "$RESULTS/train.txt"; then
  trained='<testcase classname="Train" name="debugmodel_cuda_bf16"/>'
else
  trained='<testcase classname="Train" name="debugmodel_cuda_bf16"><failure message="no step 30"/></testcase>'
  rc=1
fi
tail -8 "$RESULTS/train.txt"
printf '<testsuites><testsuite name="Train">%s</testsuite></testsuites>\n' "$trained" > "$RESULTS/train.xml"
echo "--- train: $((SECONDS - t)) s"
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
echo "--- demo: torchrun --nproc-per-node $GPUS fsdp2_demo --device=cuda"
t=$SECONDS
if "$PY" -m torch.distributed.run --nproc-per-node "$GPUS" --no-python "$BUILD/bin/examples/fsdp2_demo" \
     --device=cuda > "$RESULTS/demo.txt" 2>&1 && grep -q '^PASS' "$RESULTS/demo.txt"; then
  demo='<testcase classname="Demo" name="fsdp2_demo_cuda"/>'
else
  demo='<testcase classname="Demo" name="fsdp2_demo_cuda"><failure message="no PASS"/></testcase>'
  rc=1
fi
tail -5 "$RESULTS/demo.txt"
printf '<testsuites><testsuite name="Demo">%s</testsuite></testsuites>\n' "$demo" > "$RESULTS/demo.xml"
echo "--- demo: $((SECONDS - t)) s"

step "bench/e2e on CUDA, ours vs PyTorch FSDP2 ($GPUS ranks; compute and overhead models)"
for model in compute overhead; do
  "$PY" -m torch.distributed.run --nproc-per-node "$GPUS" --no-python "$BUILD/bin/bench/e2e_bench" --device=cuda \
    --model=$model --fsdp=2 --trace="$RESULTS/ours_$model" 2>&1 | grep '^{' | tee -a "$RESULTS/e2e.jsonl"
  (cd "$ROOT/bench/peer" && "$PY" e2e_peer.py --world "$GPUS" --model $model --fsdp 2 --device cuda \
    --trace "$RESULTS/pytorch_$model") 2>&1 | grep '^{' | tee -a "$RESULTS/e2e.jsonl"
done
"$PY" - "$RESULTS/e2e.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for model in ("compute", "overhead"):
    ours = [r for r in rows if r["impl"] == "ours" and r["model"] == model]
    theirs = [r for r in rows if r["impl"] == "pytorch" and r["model"] == model]
    if ours and theirs:
        print(f"{model}: step_ms ours {ours[0]['step_ms']:.3f} pytorch {theirs[0]['step_ms']:.3f} "
              f"ratio {ours[0]['step_ms'] / theirs[0]['step_ms']:.3f}")
PYEOF
cp "$RESULTS/ours_compute.rank0.json" "$OUT/ours.rank0.json" 2>/dev/null
cp "$RESULTS/pytorch_compute.rank0.json" "$OUT/pytorch.rank0.json" 2>/dev/null

fi  # NCCL_ONLY

step "summary"
tar -czf "$OUT/results.tgz" -C "$RESULTS" --exclude='*.rank*.json' . || echo "tar failed"
python3 "$ROOT/tools/test_summary.py" --xml "$RESULTS" || rc=1
exit $rc
