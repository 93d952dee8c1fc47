#!/usr/bin/env bash
# tools/fuzz.sh — builds the libFuzzer targets in fuzz/ with clang + ASan + UBSan (their own
# Bazel output base, so the gcc objects of `./x test` stay as they are), writes seed corpora
# from real checkpoint files (fuzz:make_seeds), and runs a bounded pass of each target.
# Prints per target the executions done and whether it crashed; the last line is
# "N passed, N failed" (one per target; passed = no crash within the budget). Exits non-zero
# on any failure. Crash inputs are kept under $FUZZ_OUT/<target>/.
#
#   tools/fuzz.sh                    # FUZZ_SECONDS=60 per target
#   FUZZ_SECONDS=600 tools/fuzz.sh   # longer runs
#   FUZZ_RUNS=1000 tools/fuzz.sh     # a fixed number of executions instead of a time budget
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${FSDP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/libtorch-fsdp}"
BASE="$CACHE/bazel-fuzz-output"
FUZZ_OUT="${FUZZ_OUT:-$CACHE/fuzz}"
SECONDS_PER_TARGET="${FUZZ_SECONDS:-60}"
TARGETS=(full_state_dict_fuzz optim_state_fuzz torchrun_env_fuzz dcp_metadata_fuzz safetensors_fuzz hf_checkpoint_fuzz fr_trace_fuzz
  token_dataset_fuzz)

command -v clang >/dev/null || { echo "fuzz: clang not found (apt-get install clang libclang-rt-14-dev)" >&2; exit 1; }
[ -e third_party/torch_root/lib/libtorch_cpu.so ] || { echo "fuzz: run ./x setup first (third_party/torch_root)" >&2; exit 1; }

# LibTorch, absl and gtest are gcc-built and uninstrumented: coverage and ASan see our code
# (and every read our code does); leaks and new/delete pairing inside LibTorch are not ours.
FLAGS=(--repo_env=CC=clang --repo_env=CXX=clang++ --define=fuzzing=libfuzzer --define=torch_pch=off
       --copt=-fsanitize=fuzzer-no-link,address,undefined --copt=-fno-sanitize=vptr
       --copt=-fno-sanitize-recover=undefined --copt=-fno-omit-frame-pointer --copt=-O1 --copt=-g
       --linkopt=-fsanitize=address,undefined --linkopt=-fsanitize-link-c++-runtime --strip=never)

echo "==> bazel build (clang, libFuzzer, ASan + UBSan): ${TARGETS[*]} make_seeds"
if ! CC=clang bazel --output_base="$BASE" build --symlink_prefix=/ "${FLAGS[@]}" \
    $(printf '//fuzz:%s ' "${TARGETS[@]}") //fuzz:make_seeds; then
  echo "fuzz: build failed"
  echo "0 passed, ${#TARGETS[@]} failed"
  exit 1
fi
BIN="$(CC=clang bazel --output_base="$BASE" info "${FLAGS[@]}" bazel-bin 2>/dev/null)/fuzz"

export ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
rm -rf "$FUZZ_OUT/seeds"
mkdir -p "$FUZZ_OUT"
echo "==> seed corpora from real files"
"$BIN/make_seeds" "$FUZZ_OUT/seeds" || { echo "fuzz: make_seeds failed"; echo "0 passed, ${#TARGETS[@]} failed"; exit 1; }
# A .metadata that Python's dcp.save wrote (pickle protocol 4), beside make_seeds' own; files
# Python's safetensors wrote beside our writer's.
cp fuzz/testdata/dcp_python.metadata "$FUZZ_OUT/seeds/dcp_metadata/"
cp fuzz/testdata/*.safetensors "$FUZZ_OUT/seeds/safetensors/"
# PyTorch's own flight recorder dumps (Gloo) beside make_seeds' dump of ours.
cp tests/testdata/pytorch_gloo_fr_dump_rank_* "$FUZZ_OUT/seeds/fr_trace/"
# The shipped corpus's validation split, as the fuzzer reads a dataset: index, then tokens.
mkdir -p "$FUZZ_OUT/seeds/token_dataset"
cat train/testdata/corpus/validation.index train/testdata/corpus/validation.tokens >"$FUZZ_OUT/seeds/token_dataset/validation"

passed=0 failed=0
for t in "${TARGETS[@]}"; do
  seeds="$FUZZ_OUT/seeds/${t%_fuzz}"
  corpus="$FUZZ_OUT/$t/corpus"      # grows across runs; $seeds is re-read every time
  mkdir -p "$corpus" "$FUZZ_OUT/$t/crashes"
  log="$FUZZ_OUT/$t/last.log"
  budget=(-max_total_time="$SECONDS_PER_TARGET")
  case "$t" in
    torchrun_env_fuzz) dict=() ;;
    safetensors_fuzz | hf_checkpoint_fuzz) dict=(-dict=fuzz/safetensors.dict) ;;
    token_dataset_fuzz) dict=(-dict=fuzz/token_dataset.dict) ;;
    *) dict=(-dict=fuzz/checkpoint.dict) ;;
  esac
  [ -n "${FUZZ_RUNS:-}" ] && budget=(-runs="$FUZZ_RUNS")
  echo "==> $t (${budget[*]})"
  "$BIN/$t" "${budget[@]}" "${dict[@]}" -timeout=10 -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="$FUZZ_OUT/$t/crashes/" "$corpus" "$seeds" >"$log" 2>&1
  rc=$?
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  if [ $rc -eq 0 ]; then
    passed=$((passed + 1))
    echo "$t: ${execs:-?} executions, no crash"
  else
    failed=$((failed + 1))
    echo "$t: ${execs:-?} executions, CRASHED (exit $rc); log $log, input(s) in $FUZZ_OUT/$t/crashes/"
    grep -m 3 -E 'ERROR: |SUMMARY: |runtime error|terminate called|what\(\)' "$log" | sed 's/^/  /'
  fi
done
echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
