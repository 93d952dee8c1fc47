# What several of ./x's commands share (sourced by ./x before the command files): the pinned
# torch version and the cache, the step and error lines, the counted parts of test and check,
# and the times file .ci/run prints. No header line: this file is not a command.

TORCH_VERSION="$(tr -d '[:space:]' < third_party/torch_version.txt)"
CACHE="${FSDP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/libtorch-fsdp}"
VENV="$CACHE/venv-torch-$TORCH_VERSION"
PY="$VENV/bin/python"

step() { printf '\n==> %s\n' "$*"; }
die() { printf '\nx: error: %s\n' "$*" >&2; exit 1; }

# A child that exited but is not yet reaped (a zombie) still answers kill -0.
run_exited() { [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" = Z ]; }

# count_check FILE CMD...: runs CMD with its output in FILE, then appends the one-case
# summary line ('1 passed, 0 failed' or '0 passed, 1 failed') that makes FILE a counted part;
# fails when CMD did.
count_check() {
  local file="$1"; shift
  if "$@" > "$file" 2>&1; then echo "1 passed, 0 failed" >> "$file"
  else echo "0 passed, 1 failed" >> "$file"; cat "$file"; return 1; fi
  cat "$file"
}

# own_cases_check FILE CMD...: runs CMD (a script printing its own 'N passed, N failed' last)
# with its output in FILE, shows it all when CMD failed, else its last line.
own_cases_check() {
  local file="$1"; shift
  "$@" > "$file" 2>&1 || cat "$file"
  tail -1 "$file"
}

# bazel-* links left pointing into another output base (older ./x check runs made them)
# would be loaded as packages by //...; a build re-creates its own.
delete_stale_bazel_links() { find "$ROOT" -maxdepth 1 -type l -name 'bazel-*' -delete; }

# bazel_test_part NAME LOG SUMMARY BAZEL_TEST_ARGS...: one `bazel test --keep_going` run, its
# output in LOG, its 'N passed, N failed' in SUMMARY (a part for test_summary.py --combine);
# fails when a test did.
bazel_test_part() {
  local name="$1" log="$2" summary="$3" rc=0; shift 3
  step "bazel test $*"
  bazel test --keep_going "$@" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
  step "results ($name)"
  python3 tools/test_summary.py "$log" "$(bazel info bazel-testlogs 2>/dev/null)" | tee "$summary" || rc=1
  return "$rc"
}

# ---------------------------------------------------------------- wall times
# `./x test` and `./x check` write each part's wall time, one 'NAME SECONDS' line per part, to
# build/x-times-COMMAND.txt; .ci/run prints them as a table, so a part that grows is seen
# before it reaches CI's time limit.
X_TIMES_FILE=""
times_begin() {
  mkdir -p "$ROOT/build"
  X_TIMES_FILE="$ROOT/build/x-times-$1.txt"
  : > "$X_TIMES_FILE"
}
times_add() { [ -z "$X_TIMES_FILE" ] || echo "$1 $2" >> "$X_TIMES_FILE"; }

# lap NAME [LABEL]: the seconds since the caller's t0 go to the times file as NAME (unless
# empty) and, with LABEL, onto the caller's times string as 'LABEL N s' (its results step
# shows it); t0 restarts. t0 and times are the caller's locals (bash's dynamic scope).
lap() {
  local s=$((SECONDS - t0))
  [ -z "$1" ] || times_add "$1" "$s"
  [ $# -lt 2 ] || times="${times:+$times, }$2 $s s"
  t0=$SECONDS
}
