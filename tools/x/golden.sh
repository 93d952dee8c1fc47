# x golden: set up, rewrite the golden files (*/testdata/golden_*.txt) with the peer venv's real PyTorch
#   Each testing/golden/gen_*.py rewrites its files in place with the peer venv's PyTorch (the
#   pinned version, named on their first line); a rerun reproduces them byte for byte.

x_golden() { cmd_golden "$@"; }

# The golden corpora are written by real PyTorch (the pinned version, from the peer venv):
# each testing/golden/gen_*.py rewrites its files in place; their first line names the torch
# version. Deterministic: a rerun on any machine reproduces them byte for byte.
cmd_golden() {
  [ $# -eq 0 ] || die "golden takes no arguments, got '$*'"
  cmd_setup
  [ -n "$PEER_PY" ] || die "golden needs the peer venv with PyTorch $TORCH_VERSION ($PEER_VENV); ./x setup could not install it"
  # The FSDP generator reads tensors through NumPy (torch's wheel does not depend on it).
  if ! "$PEER_PY" -c 'import numpy' 2>/dev/null; then
    step "numpy in the peer venv (for the golden generators)"
    pip_install "$PEER_PY" numpy || die "pip install numpy failed (PyPI unreachable?)"
  fi
  local gen t0
  for gen in testing/golden/gen_*.py; do
    [ -e "$gen" ] || die "no generators in testing/golden/"
    step "$gen (peer PyTorch $TORCH_VERSION)"
    t0=$SECONDS
    "$PEER_PY" "$gen" || die "$gen failed"
    echo "$gen: $((SECONDS - t0)) s"
  done
}
