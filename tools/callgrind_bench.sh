#!/usr/bin/env bash
# Instruction counts (valgrind's callgrind) of the micro-benchmarks whose wall times are noisy
# on a shared machine: ours vs the reference per iteration, and their ratio.
#   bench/fsdp2_bench: Step/{ours,raw}/<blocks> (FSDP2 bookkeeping per step),
#                      CopyIn|CopyOut/{ours,memcpy}/<bytes> (all-gather copy-in / copy-out)
#   bench/fsdp1_bench: Step/{ours,fsdp2}/<blocks> (FSDP1 vs FSDP2 step),
#                      Unflatten/{ours,narrow}/<n> (FlatParamHandle views vs narrow+view)
# Each benchmark runs a fixed number of iterations once (--callgrind_iterations); only the
# timed loop is instrumented (bench/callgrind_loop.h) and dumped under its name; the dumps
# land in bench/out/callgrind/ (callgrind_annotate FILE shows where the instructions go).
# Instructions are not time: copies are counted in vector instructions (32 bytes each), ATen's
# per-tensor bookkeeping in many cheap ones, so for the copies the ours-ref column
# (instructions added per iteration) says more than the ratio. glibc's memcpy (which our
# copy-in / copy-out use) switches to `rep movsb` above a size threshold, and valgrind counts
# every byte of a rep-prefixed instruction as an instruction (16 MiB: 16M "instructions" vs
# 0.5M for the vector loop ATen's copy_ uses); GLIBC_TUNABLES below keeps memcpy on its
# vector loop so that both sides count the same kind of instructions.
#
# Last, tools/callgrind_budget.py turns the Step dumps into FSDP2's and FSDP1's instructions
# per wrapped Linear (and per parameter) beyond plain LibTorch and checks them against
# bench/callgrind_budget.json: more than 10% above it fails (exit status 1).
#
#   tools/callgrind_bench.sh [--iterations N]     (default 5; about 2 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

iterations=5
[ "${1:-}" = "--iterations" ] && iterations="$2"
command -v valgrind >/dev/null || { echo "callgrind_bench: valgrind is not installed (./x setup installs it)" >&2; exit 1; }

bazel build --config=opt //bench:fsdp2_bench //bench:fsdp1_bench
bin="$(bazel info --config=opt bazel-bin 2>/dev/null)/bench"
out=bench/out/callgrind
rm -rf "$out"
mkdir -p "$out"

huge=4611686018427387904  # 2^62 bytes: never use rep movsb / rep stosb

# run NAME FILTER: one benchmark binary under callgrind, its log in $out/NAME.log.
run() {
  local name="$1" filter="$2" t0=$SECONDS
  echo "callgrind: $name ($filter), $iterations iterations each"
  GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=$huge:glibc.cpu.x86_rep_stosb_threshold=$huge \
  valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no \
    --callgrind-out-file="$out/$name.%p" "$bin/$name" --pair_repetitions=1 \
    --callgrind_iterations="$iterations" --benchmark_filter="$filter" > "$out/$name.log" 2>&1 \
    || { tail -20 "$out/$name.log"; exit 1; }
  echo "  $((SECONDS - t0)) s"
}
run fsdp2_bench '^(Step/(ours|raw)/(16|64)/|Copy(In|Out)/(ours|memcpy)/(1048576|16777216)/)'
run fsdp1_bench '^(Step/(ours|fsdp2)/(8|32)/|Plain/raw/(8|32)/|Unflatten/(ours|narrow)/(16|256)/)'

for name in fsdp2_bench fsdp1_bench; do
  echo
  echo "$name: instructions per iteration (Ir), ours vs reference (Step: blocks; CopyIn/CopyOut: bytes; Unflatten: parameters)"
  python3 tools/bench_ratio.py --callgrind "$out/$name"
done

echo
echo "FSDP bookkeeping per step beyond plain LibTorch, against bench/callgrind_budget.json (flags > 10% growth)"
python3 tools/callgrind_budget.py "$out"
