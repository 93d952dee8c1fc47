# x run -n N BIN [ARG ...]: launch N processes of BIN (in the caller's directory) with torchrun's environment; Ctrl-C stops every rank
#   Options come before BIN, in any order (-n N, -n=N, --nproc-per-node N); what follows BIN
#   is BIN's. Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
#   MASTER_PORT. The first rank that fails stops the others; Ctrl-C or SIGTERM stops every
#   rank. Exit status: 0 when every rank exited 0, else the first failing rank's (130 / 143
#   after SIGINT / SIGTERM). Details: docs/guide/torchrun.md.

# `./x run` starts the ranks where the caller stood (relative programs and arguments are the
# caller's); the demos and benchmarks call cmd_run with RUN_DIR the checkout.
x_run() { RUN_DIR="$CALLER_DIR" cmd_run "$@"; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Seconds the ranks get to exit after SIGTERM (Ctrl-C, or another rank failed) before SIGKILL.
RUN_GRACE_S=10

# ./x run -n N BIN [ARG...]: N processes of BIN with torchrun's environment. Options come
# before BIN, in any order (-n N, -n=N, --nproc-per-node N); what follows BIN is BIN's. As
# torchrun does, the first rank that fails stops the others. Ctrl-C (SIGINT) or SIGTERM
# stops every rank: background processes of a script ignore SIGINT, so they get SIGTERM, then
# SIGKILL after RUN_GRACE_S. Exit status: 0 when every rank exited 0, else the first failing
# rank's status (130 / 143 after SIGINT / SIGTERM).
# cmd_run -n N BIN [ARG...]: the ranks run in RUN_DIR (the caller's directory for `./x run`,
# the checkout for the demos and benchmarks).
RUN_DIR="$ROOT"
cmd_run() {
  local n=""
  while [ $# -gt 0 ]; do
    case "$1" in
      -n|--nproc-per-node|--nproc_per_node) [ $# -ge 2 ] || die "run: $1 needs a value"; n="$2"; shift 2 ;;
      -n=*|--nproc-per-node=*|--nproc_per_node=*) n="${1#*=}"; shift ;;
      --) shift; break ;;
      -*) die "run: unknown option '$1' (usage: ./x run -n N BIN [ARG...])" ;;
      *) break ;;
    esac
  done
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "run: -n must be a positive integer, got '${n}'"
  [ $# -ge 1 ] || die "run: missing binary (usage: ./x run -n N BIN [ARG...])"
  local bin="$1"; shift
  local port; port="$(free_port)"
  RUN_PIDS=()
  RUN_STOPPING="" RUN_SIGNAL_STATUS=""
  # The traps go first: a signal while the ranks start must stop those already running (without
  # a trap bash would die and leave them, holding its stdout). Bash runs a trap between
  # commands, so a rank started just before it is stopped after the loop.
  trap 'run_stop_ranks SIGINT 130' INT
  trap 'run_stop_ranks SIGTERM 143' TERM
  local r
  for ((r = 0; r < n; r++)); do
    [ -z "$RUN_STOPPING" ] || break
    (cd "$RUN_DIR" && RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port exec "$bin" "$@") &
    RUN_PIDS+=($!)
  done
  [ -z "$RUN_STOPPING" ] || run_stop_ranks "" ""
  local rc=0 live st pid
  # Polls rather than waits on one rank: a rank that fails first must stop the others even
  # when rank 0 is still blocked in a collective with it.
  while :; do
    live=0
    for r in "${!RUN_PIDS[@]}"; do
      pid="${RUN_PIDS[$r]}"
      [ -n "$pid" ] || continue
      if kill -0 "$pid" 2>/dev/null && ! run_exited "$pid"; then live=$((live + 1)); continue; fi
      st=0
      wait "$pid" || st=$?
      RUN_PIDS[r]=""
      if [ "$st" -ne 0 ]; then
        [ "$rc" -ne 0 ] || rc=$st
        if [ -z "$RUN_STOPPING" ]; then
          echo "x run: rank $r exited with $st; stopping the others" >&2
          run_stop_ranks "" ""
        fi
      fi
    done
    [ "$live" -gt 0 ] || break
    sleep 0.2
  done
  trap - INT TERM
  [ -z "$RUN_SIGNAL_STATUS" ] || rc="$RUN_SIGNAL_STATUS"
  return "$rc"
}

# run_stop_ranks SIGNAL STATUS: SIGTERM to every live rank, SIGKILL to those left after
# RUN_GRACE_S. SIGNAL non-empty: we were signalled; the run's status becomes STATUS.
run_stop_ranks() {
  [ -z "$1" ] || { echo "x run: $1: stopping the ranks" >&2; RUN_SIGNAL_STATUS="$2"; }
  RUN_STOPPING=1
  local pid t
  for pid in "${RUN_PIDS[@]}"; do [ -z "$pid" ] || kill -TERM "$pid" 2>/dev/null || true; done
  for ((t = 0; t < RUN_GRACE_S * 10; t++)); do
    local any=0
    for pid in "${RUN_PIDS[@]}"; do
      if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && ! run_exited "$pid"; then any=1; fi
    done
    [ $any -eq 1 ] || return 0
    sleep 0.1
  done
  for pid in "${RUN_PIDS[@]}"; do [ -z "$pid" ] || kill -KILL "$pid" 2>/dev/null || true; done
}
