#!/usr/bin/env bash
# Instruction counts (valgrind's callgrind) of the pipeline runtimes' host work per action:
# bench/pipelining's Overhead loops (ours) and PyTorch 2.15's schedules with the same model
# (bench/peer/pipelining_peer.py), both as the last rank of a fake process group of 2 ranks in
# one process, where sends and receives return at once. Timing resolves per-action overhead
# only to a few microseconds on a shared machine; instruction counts do not move with load.
# Each loop runs twice with different step counts, each run dumped, and the instructions per
# step are the slope between the two (which cancels what bracketing a loop costs: PyTorch's
# side toggles callgrind from Python). tools/callgrind_pipelining.py prints per schedule the
# instructions per action beyond the raw loop on each side, and their ratio.
#
#   tools/callgrind_pipelining.sh PEER_PYTHON     (about 4 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python="${1:?usage: tools/callgrind_pipelining.sh PEER_PYTHON (the peer venv python with PyTorch 2.15)}"
command -v valgrind >/dev/null || { echo "callgrind_pipelining: valgrind is not installed (./x setup installs it)" >&2; exit 1; }

bazel build --config=opt //bench:pipelining_bench
bin="$(bazel info --config=opt bazel-bin 2>/dev/null)/bench"
out=bench/out/callgrind_pipelining
rm -rf "$out"
mkdir -p "$out"

t0=$SECONDS
valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no --callgrind-out-file="$out/ours.%p" \
  "$bin/pipelining_bench" --fake_world=2 --callgrind=1 --pair_repetitions=1 --benchmark_color=false > "$out/ours.log" 2>&1 \
  || { tail -20 "$out/ours.log"; exit 1; }
echo "callgrind: ours, $((SECONDS - t0)) s"
t0=$SECONDS
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out/pytorch.%p" \
  "$python" bench/peer/pipelining_peer.py --world 2 --backend fake --callgrind > "$out/pytorch.log" 2>&1 \
  || { tail -20 "$out/pytorch.log"; exit 1; }
echo "callgrind: PyTorch, $((SECONDS - t0)) s"
python3 tools/callgrind_pipelining.py "$out"
