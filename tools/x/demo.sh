# x demo [ARG ...]: set up, build, train the demo on 4 processes, checkpoint, resume on 2; then Llama vs Hugging Face, and `train`
#   The FSDP2 demo (examples/fsdp2_demo.cc; ARGs go to it) trains on 4 processes and
#   checkpoints to build/demo, then resumes on 2; the Llama demo (examples/llama) trains
#   against Hugging Face's LlamaForCausalLM under PyTorch's FSDP2 from the peer venv, exports,
#   and resumes; the trainer (`train`, train/configs/demo.toml) trains a transformers-initialized
#   Llama 3 on a 2 x 2 mesh, plots its curves, exports, and transformers checks the export's
#   held-out loss (both skipped, with the reason, without transformers in the peer venv).

x_demo() { cmd_demo "$@"; }

cmd_demo() {
  # The FSDP2 showcase (examples/fsdp2_demo.cc). The communication-layer demo stays runnable:
  # bazel build --config=opt //examples:collectives_demo && ./x run -n 4 bazel-bin/examples/collectives_demo
  local targets=(//examples:fsdp2_demo //examples/llama:llama_demo //train:train)
  setup_begin
  step "bazel build -c opt ${targets[*]}"
  bazel build --config=opt "${targets[@]}"
  # The opt output directory itself: bazel-bin follows whichever configuration built last.
  local bin; bin="$(bazel info --config=opt bazel-bin 2>/dev/null)/examples/fsdp2_demo"
  # Relative to the repository root (./x runs there; build/ is git-ignored). Emptied first so
  # the resumed run can only read what this run saved.
  local ckpt=build/demo
  rm -rf "$ckpt" && mkdir -p "$ckpt"
  step "training with fully_shard on 4 processes (Gloo over TCPStore on 127.0.0.1), then the same on one rank; checkpoint to $ckpt/"
  cmd_run -n 4 "$bin" --checkpoint_dir="$ckpt" "$@"
  step "resuming from $ckpt/dcp on 2 processes (another world size), vs a single-rank run without the break"
  cmd_run -n 2 "$bin" --checkpoint_dir="$ckpt" --resume "$@"
  # The Llama part needs the peer venv (on a fresh machine it has been installing meanwhile).
  setup_finish
  demo_llama
  demo_train
}

# The Llama part (examples/llama/llama_demo.cc): the reference is Hugging Face's
# LlamaForCausalLM trained under PyTorch's FSDP2 in the peer venv, which also writes the
# initial weights with save_pretrained; the C++ run loads them into its shards, trains, and
# exports in the same layout, which transformers loads (hf_check_export.py). Without the peer venv or transformers it is skipped, with
# the reason (as the parity test is).
demo_llama() {
  if [ -z "$PEER_PY" ] || ! "$PEER_PY" -c "import transformers" 2>/dev/null; then
    echo "Llama demo skipped: it needs transformers in the peer venv ($PEER_VENV), which ./x setup installs"
    return 0
  fi
  local bin; bin="$(bazel info --config=opt bazel-bin 2>/dev/null)/examples/llama/llama_demo"
  local ref=build/demo/llama_ref ckpt=build/demo/llama export=build/demo/llama_hf
  rm -rf "$ref" "$ckpt" "$export" "${export}_logits.pt"
  # "2": the reference also holds the one-process f32 run split as 2 ranks split it, the
  # resumed run's summation order (its tolerance derives from that spread).
  step "the reference: HF transformers' LlamaForCausalLM under PyTorch FSDP2, 4 processes, 20 steps -> $ref"
  "$PEER_PY" examples/llama/testdata/hf_llama_fsdp2.py 4 20 "$ref" 2 | tail -1
  step "Llama in C++ from $ref/hf_init (save_pretrained's files): FSDP2 per layer + root, activation checkpointing, clip_grad_norm, 4 processes, vs that reference; DCP checkpoint after step 10 -> $ckpt; export -> $export"
  cmd_run -n 4 "$bin" --reference_dir="$ref" --checkpoint_dir="$ckpt" --export_dir="$export"
  step "transformers loads the export ($export) and compares its logits with ours"
  "$PEER_PY" examples/llama/testdata/hf_check_export.py "$export" "${export}_logits.pt"
  step "Llama resumed from $ckpt's step-10 checkpoint on 2 processes, vs the same reference"
  cmd_run -n 2 "$bin" --reference_dir="$ref" --checkpoint_dir="$ckpt"
}

# The trainer part (train/train_main.cc, docs/guide/train.md): a small Llama 3 that transformers
# initializes and saves (train/testdata/make_hf_init.py), trained by `train` from
# train/configs/demo.toml (the shipped corpus, FSDP 2 x TP 2, 30 steps of warmup and cosine
# decay, validation every 10) and exported in Hugging Face's layout; the curves to a PNG
# (tools/plot_metrics.py); transformers loads the export and its held-out loss must equal the
# run's last validation loss (train/testdata/hf_check_train_export.py: PASS or FAIL).
demo_train() {
  if [ -z "$PEER_PY" ] || ! "$PEER_PY" -c "import transformers" 2>/dev/null; then
    echo "trainer demo skipped: it needs transformers in the peer venv ($PEER_VENV), which ./x setup installs"
    return 0
  fi
  local bin; bin="$(bazel info --config=opt bazel-bin 2>/dev/null)/train/train"
  local init=build/demo/train_init out=build/demo/train
  rm -rf "$init" "$out"
  step "a small Llama 3 initialized by transformers (save_pretrained) -> $init"
  "$PEER_PY" train/testdata/make_hf_init.py "$init" | tail -1
  step "train --config train/configs/demo.toml: from $init, FSDP 2 x TP 2 on 4 processes, 30 steps; export -> $out/checkpoint"
  cmd_run -n 4 "$bin" --config train/configs/demo.toml
  step "the curves: tools/plot_metrics.py -> $out/curves.png"
  "$PEER_PY" tools/plot_metrics.py "$out/metrics.jsonl" --output "$out/curves.png"
  step "transformers loads the export and computes the held-out loss, vs the run's last validation loss"
  "$PEER_PY" train/testdata/hf_check_train_export.py train/configs/demo.toml 4
}
