# x test [TARGET|--FLAG ...]: set up, then the whole suite (bazel test //..., docs links, the AVX2 rerun); 'N passed, N failed'
#   With no TARGET: the checks of the tree (CMake target list, doc links and claims, layering,
#   rules on targets, C++ format, ./x itself), one counted part each; `bazel test //...` once
#   (not the benchmarks, fuzzers and header checks: ./x check builds those); then the tests
#   tagged float_parity again under ATEN_CPU_CAPABILITY=avx2 when this CPU picks more
#   (FSDP_AVX2_RERUN=1 forces the rerun, =0 leaves it out). Each part prints its own
#   'N passed, N failed'; the last line sums them (CI reads only that line).
#   With TARGETs (and Bazel flags, in any order): only bazel test of those.

# Why the rerun: ATen's kernels sum in another order per CPU capability, and CI machines have
# AVX2 only. The other ways to build the project (CMake, the consumer workspaces, the CUDA
# link, each public header alone) are `./x check`'s.
x_test() { cmd_test "$@"; }

# The highest ATen CPU capability this CPU has, as ATen's dispatcher picks it
# (aten/src/ATen/native/DispatchStub.cpp): avx512 needs AVX-512 F, BW, VL and DQ.
best_cpu_capability() {
  local flags; flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
  local f
  for f in avx512f avx512bw avx512vl avx512dq; do
    [[ " $flags " == *" $f "* ]] || { [[ " $flags " == *" avx2 "* ]] && echo avx2 || echo default; return; }
  done
  echo avx512
}

# tree_check NAME count|own STEP CMD...: one check of the tree as the part NAME, its output in
# build/test-NAME.txt: `count` for a check that passes or fails as one case (count_check),
# `own` for a script that counts its own cases (own_cases_check). Appends to the caller's
# parts; records the part's time.
tree_check() {
  local name="$1" how="$2" file="$ROOT/build/test-$1.txt" t0=$SECONDS
  step "$3"; shift 3
  if [ "$how" = count ]; then count_check "$file" "$@" || true; else own_cases_check "$file" "$@"; fi
  parts+=("$name=$file")
  lap "$name"
}

test_tree_checks() {
  tree_check cmake-targets count "generated CMake targets: python3 tools/gen_cmake_targets.py --check" \
    python3 tools/gen_cmake_targets.py --check
  tree_check doc-links count "links of README.md and docs/: python3 tools/check_doc_links.py" \
    python3 tools/check_doc_links.py "$ROOT"
  tree_check layering count "layering (declared includes, private by default, internals, the allowed package edges): python3 tools/check_layering.py" \
    python3 tools/check_layering.py "$ROOT"
  tree_check target-deps count "rules on targets (FSDP2-only, DCP adapters, peer_python tags; bazel query): python3 tools/check_target_deps.py" \
    python3 tools/check_target_deps.py "$ROOT"
  tree_check doc-claims count "what README.md and docs/ name (targets, paths, test filters, C++ names, flags): python3 tools/check_doc_claims.py" \
    python3 tools/check_doc_claims.py "$ROOT"
  tree_check format count "C++ sources as .clang-format leaves them: python3 tools/check_format.py" \
    python3 tools/check_format.py "$ROOT"
  tree_check layering-check own "the layering check on planted violations: python3 tools/check_layering_test.py" \
    python3 tools/check_layering_test.py
  tree_check doc-claims-check own "the doc-claims check on planted false claims: python3 tools/check_doc_claims_test.py" \
    python3 tools/check_doc_claims_test.py
  tree_check x own "./x run (its signals and failing ranks, the caller's directory, arguments): python3 tools/x_run_test.py" \
    python3 tools/x_run_test.py "$ROOT"
  tree_check plot-metrics own "the trainer's curves plot on two small runs: python3 tools/plot_metrics_test.py" \
    python3 tools/plot_metrics_test.py
  tree_check pipeline-overhead own "the pipeline overhead table from made-up callgrind dumps: python3 tools/callgrind_pipelining_test.py" \
    python3 tools/callgrind_pipelining_test.py
  tree_check x-commands own "./x's commands with a fake bazel (help, arguments, test, check, setup, .ci/run): python3 tools/x_test.py" \
    python3 tools/x_test.py "$ROOT"
}

# cmd_test [TARGET...] [--BAZEL_FLAG...]
cmd_test() {
  local targets=() flags=() arg whole=0 user_tag_filter=0
  for arg in "$@"; do
    case "$arg" in
      --test_tag_filters*) flags+=("$arg"); user_tag_filter=1 ;;
      -*) flags+=("$arg") ;;
      *) targets+=("$arg") ;;
    esac
  done
  if [ ${#targets[@]} -eq 0 ]; then targets=(//...); whole=1; fi
  times_begin test
  local t_cmd=$SECONDS t0=$SECONDS
  if [ $whole -eq 1 ]; then setup_begin; else cmd_setup; fi
  # A filter of the caller's own leaves one part: the peer venv first.
  [ $user_tag_filter -eq 0 ] || setup_finish
  lap set-up
  mkdir -p "$ROOT/build"
  local parts=() t_all=$SECONDS
  if [ $whole -eq 1 ]; then test_tree_checks; fi
  local rc=0 times=""
  t0=$SECONDS
  delete_stale_bazel_links
  # The whole suite builds the tests and what they run, not the benchmarks, fuzzers and
  # programs no test runs (`./x check` builds those: bazel build //...).
  # Nor the public headers compiled one by one (the headers_alone tests of tools/cc.bzl): a
  # build check like the CMake build, in `./x check`.
  local scope=("${targets[@]}") tags=""
  [ $whole -eq 0 ] || { scope=(--build_tests_only //...); tags="-headers_alone,"; }
  local b="$ROOT/build/test-bazel.txt" bp="$ROOT/build/test-bazel-peer.txt" split=0
  if [ -n "$PEER_SETUP_PID" ]; then
    # A fresh machine: the tests compile while the peer venv installs. Should it still be
    # installing then (a slow network), the tests that do not need it (no tag peer_python)
    # run meanwhile and the others after it; else they all run at once (two parts would
    # leave the second, a few long tests, on one core at the end).
    step "bazel build ${scope[*]} --test_tag_filters=${tags%,} ${flags[*]} (the peer venv installs meanwhile)"
    bazel build --keep_going "${scope[@]}" --test_tag_filters="${tags%,}" "${flags[@]}" ||
      echo "the build failed; the tests below report what did not build"
    lap build build
    if kill -0 "$PEER_SETUP_PID" 2>/dev/null && ! run_exited "$PEER_SETUP_PID"; then
      split=1
      bazel_test_part bazel "$ROOT/bazel-test.log" "$b" "${scope[@]}" --test_tag_filters="${tags}-peer_python" \
        "${flags[@]}" || rc=1
      lap bazel bazel
      setup_finish
      bazel_test_part bazel-peer "$ROOT/bazel-test-peer.log" "$bp" "${scope[@]}" --test_tag_filters="${tags}peer_python" \
        "${flags[@]}" || rc=1
      parts+=(bazel="$b" bazel-peer="$bp")
      lap bazel-peer "peer tests (and the wait)"
    fi
    setup_finish
  fi
  if [ $split -eq 0 ]; then
    bazel_test_part bazel "$ROOT/bazel-test.log" "$b" "${scope[@]}" ${tags:+--test_tag_filters="${tags%,}"} "${flags[@]}" ||
      rc=1
    parts+=(bazel="$b")
    lap bazel bazel
  fi
  local best; best="$(best_cpu_capability)"
  local rerun="${FSDP_AVX2_RERUN:-}"
  [ -n "$rerun" ] || { [ "$best" = avx512 ] && rerun=1 || rerun=0; }
  if [ $whole -eq 1 ] && [ "$rerun" = 1 ]; then
    t0=$SECONDS
    step "the float_parity tests again under ATEN_CPU_CAPABILITY=avx2 (this CPU: $best), as CI's AVX2 machines run them"
    local avx2="$ROOT/build/test-avx2.txt"
    bazel_test_part avx2 "$ROOT/bazel-test-avx2.log" "$avx2" --test_tag_filters=float_parity \
      --test_env=ATEN_CPU_CAPABILITY=avx2 "${flags[@]}" --build_tests_only //... || rc=1
    parts+=(avx2="$avx2")
    lap avx2 "avx2 rerun"
  elif [ $whole -eq 1 ]; then
    echo "float_parity rerun under ATEN_CPU_CAPABILITY=avx2: not needed (this CPU's best is $best)"
  fi
  times_add total $((SECONDS - t_cmd))
  step "results (${parts[*]%%=*}; times: $times, all $((SECONDS - t_all)) s)"
  python3 tools/test_summary.py --combine "${parts[@]}" || rc=1
  return "$rc"
}
