#!/usr/bin/env bash
# Builds and tests examples/consumer_bazel, a separate Bazel workspace that depends on this
# repository through local_repository + //:deps.bzl, as another project would.
#
#   tools/consumer_bazel.sh        (after ./x setup; prints 'N passed, N failed' last)
#
# Uses its own Bazel output base under the cache directory (the consumer is another
# workspace; sharing this repository's server would thrash it) and the shared disk cache.
# Writes examples/consumer_bazel/.bazelrc.user (git-ignored): disk cache + rpath to the
# torch wheel's lib/. Exit status: non-zero when the build, a test or the demo failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONSUMER="$ROOT/examples/consumer_bazel"
CACHE="${FSDP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/libtorch-fsdp}"
OUTPUT_BASE="$CACHE/bazel-consumer-output"
DISK_CACHE="$CACHE/bazel-disk"
LOG="$CACHE/consumer-bazel-test.log"

step() { printf '\n==> %s\n' "$*"; }
run() { printf '+ %s\n' "$*"; "$@"; }
die() { printf 'consumer_bazel: error: %s\n' "$*" >&2; echo "0 passed, 1 failed"; exit 1; }

TORCH_ROOT="$(readlink -f "$ROOT/third_party/torch_root" 2>/dev/null || true)"
[ -n "$TORCH_ROOT" ] && [ -f "$TORCH_ROOT/lib/libtorch_cpu.so" ] ||
  die "third_party/torch_root does not point at a torch wheel with lib/libtorch_cpu.so: run ./x setup"
command -v bazel >/dev/null 2>&1 || die "bazel not found: run ./x setup"

mkdir -p "$CACHE" "$DISK_CACHE"
cat > "$CONSUMER/.bazelrc.user" <<EOF
# Written by tools/consumer_bazel.sh; machine-specific, git-ignored.
build --disk_cache=$DISK_CACHE
build --linkopt=-Wl,-rpath,$TORCH_ROOT/lib
EOF

cd "$CONSUMER" || die "no $CONSUMER"
BAZEL=(bazel --output_base="$OUTPUT_BASE" --max_idle_secs=600)
rc=0

step "consumer workspace $CONSUMER (output base $OUTPUT_BASE, disk cache $DISK_CACHE)"
cat .bazelrc.user

step "bazel test //... (the consumer's tests, building @libtorch_fsdp as an external repository)"
printf '+ (cd %s && %s test --keep_going //... | tee %s)\n' "$CONSUMER" "${BAZEL[*]}" "$LOG"
"${BAZEL[@]}" test --keep_going //... 2>&1 | tee "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

step "bazel run //:consumer_demo -- 4 (FSDP2 on 4 threaded ranks vs one rank)"
run "${BAZEL[@]}" run //:consumer_demo -- 4 || rc=1

step "results (consumer tests)"
TESTLOGS="$("${BAZEL[@]}" info bazel-testlogs 2>/dev/null)"
[ $rc -eq 0 ] || echo "consumer build, tests or demo FAILED (see above; log: $LOG)"
python3 "$ROOT/tools/test_summary.py" "$LOG" "$TESTLOGS" || rc=1
exit $rc
