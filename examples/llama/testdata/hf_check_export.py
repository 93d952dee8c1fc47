"""Loads a Hugging Face export of the C++ Llama with transformers and compares its logits with
the C++ model's: the last step of `./x demo`'s Llama part and of llama_parity_test.

Usage: hf_check_export.py EXPORT_DIR LOGITS_FILE
EXPORT_DIR: what dcp::SaveHuggingFace wrote (model-0000i-of-0000N.safetensors, the index, and
config.json copied from the directory it was loaded from). LOGITS_FILE: a torch.save'd dict of
"tokens" [B, T] and "logits" [B, T, V], the C++ model's output on those tokens.
AutoModelForCausalLM.from_pretrained(EXPORT_DIR) computes the logits again, in float32 and in
float64. Tolerance: 2 * E, E = the float32 forward's own error against float64 (relative to
max(1, |logits|)): ours and transformers' are float32 evaluations of the same function, each
within E of the exact result when no less accurate than this one (the triangle inequality, as
llama_training.h TrainingTolerance argues). A wrong or missing weight is off by far more.
Prints the figures and PASS (exit 0) or FAIL (exit 1).
"""
import sys
import warnings

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging


def rel(got, want):
    return ((got.double() - want.double()).abs().max() / max(1.0, want.double().abs().max().item())).item()


def main():
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} EXPORT_DIR LOGITS_FILE")
    warnings.filterwarnings("ignore")
    hf_logging.disable_progress_bar()
    ours = torch.load(sys.argv[2])
    tokens, logits = ours["tokens"], ours["logits"]
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="eager", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        hf32 = model(input_ids=tokens).logits
        hf64 = model.double()(input_ids=tokens).logits
    error, diff = rel(hf32, hf64), rel(logits, hf32)
    tol = 2 * error
    ok = logits.shape == hf32.shape and diff <= tol
    print(f"transformers.AutoModelForCausalLM.from_pretrained({sys.argv[1]}): logits on {tuple(tokens.shape)} "
          f"tokens vs ours: max diff {diff:.2e} (tol {tol:.2e} = 2 x its float32 error vs float64)")
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
