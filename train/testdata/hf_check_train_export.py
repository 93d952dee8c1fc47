"""Loads the Hugging Face export of a `train` run with transformers and compares its loss on the
held-out set with the run's own last validation loss: the last step of `./x demo`'s trainer part.

usage: hf_check_train_export.py CONFIG.toml WORLD_SIZE

From CONFIG (train/configs/demo.toml): the export (dump_folder/checkpoint.folder/step-<steps>,
what dcp::SaveHuggingFace wrote with hf_assets_path's config.json), the run's metrics
(dump_folder/metrics.save_jsonl_file: its last "validation_metrics/loss"), and what the run's
validator read: the windows of validator.dataset_path packed as train/dataloader.h documents
(torchtitan's packing: each document's inputs t[:-1], labels t[1:], positions 0.. per
document, cut into seq_len windows; positions restart at each window), the whole global
batches of one pass, at most validator.steps of them. AutoModelForCausalLM.from_pretrained
computes the summed cross-entropy over those windows (rotary positions per document, as
position_ids) divided by the token count, in float32 and in float64. Tolerance: 2 * E + 8
float32 ulps, E = the float32 loss's own error against float64 (relative): ours and
transformers' are float32 evaluations of the same function, each within E of the exact value
(the triangle inequality, as examples/llama/testdata/hf_check_export.py argues), and the floor
covers an E that happens to be tiny. A missing or wrong weight is off by far more. Prints the
figures and PASS (exit 0) or FAIL (exit 1).
"""
import json
import os
import sys
import tomllib
import warnings

import numpy as np
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging


def documents(prefix):
    index = np.fromfile(prefix + ".index", dtype=np.uint8)
    token_bytes = int(index[12:16].view(np.uint32)[0])
    n_docs = int(index[40:48].view(np.uint64)[0])
    offsets = index[64:64 + 8 * (n_docs + 1)].view(np.uint64).astype(np.int64)
    tokens = np.fromfile(prefix + ".tokens", dtype=np.uint16 if token_bytes == 2 else np.uint32).astype(np.int64)
    return [tokens[offsets[d]:offsets[d + 1]] for d in range(n_docs)]


def windows(prefix, seq_len, count):
    inputs, labels, positions = [], [], []
    for t in documents(prefix):
        if len(t) < 2:
            continue
        inputs.append(t[:-1])
        labels.append(t[1:])
        positions.append(np.arange(len(t) - 1))
    inputs, labels, positions = (np.concatenate(a) for a in (inputs, labels, positions))
    out = []
    for k in range(count):
        s = slice(k * seq_len, (k + 1) * seq_len)
        p = positions[s].copy()
        first_zero = np.argmax(p == 0) if (p == 0).any() else len(p)
        p[:first_zero] -= p[0]  # torchtitan's _normalize_positions
        out.append((inputs[s], labels[s], p))
    return out, len(inputs) // seq_len


def main():
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} CONFIG.toml WORLD_SIZE")
    warnings.filterwarnings("ignore")
    hf_logging.disable_progress_bar()
    with open(sys.argv[1], "rb") as f:
        config = tomllib.load(f)
    world = int(sys.argv[2])
    training, parallelism, validator = config["training"], config.get("parallelism", {}), config["validator"]
    dump = config.get("dump_folder", "./outputs")
    export = os.path.join(dump, config.get("checkpoint", {}).get("folder", "checkpoint"), f"step-{training['steps']}")
    dp = world // (parallelism.get("tensor_parallel_degree", 1))
    per_batch = training["local_batch_size"] * dp
    seq_len = training["seq_len"]
    _, available = windows(validator["dataset_path"], seq_len, 0)
    batches = available // per_batch
    if validator.get("steps", -1) != -1:
        batches = min(batches, validator["steps"])
    rows, _ = windows(validator["dataset_path"], seq_len, batches * per_batch)
    with open(os.path.join(dump, config.get("metrics", {}).get("save_jsonl_file", "metrics.jsonl"))) as f:
        ours = [json.loads(line)["validation_metrics/loss"] for line in f if "validation_metrics/loss" in line][-1]

    model = AutoModelForCausalLM.from_pretrained(export, attn_implementation="sdpa", dtype=torch.float32).eval()
    ids = torch.tensor(np.stack([r[0] for r in rows]))
    labels = torch.tensor(np.stack([r[1] for r in rows]))
    positions = torch.tensor(np.stack([r[2] for r in rows]))

    def loss(m, dtype):
        with torch.no_grad():
            logits = m(input_ids=ids, position_ids=positions).logits
        return torch.nn.functional.cross_entropy(logits.to(dtype).flatten(0, 1), labels.flatten(),
                                                 reduction="sum").item() / labels.numel()

    hf32 = loss(model, torch.float32)  # torchtitan's loss takes float32 logits, as ours
    hf64 = loss(model.double(), torch.float64)
    error = abs(hf32 - hf64) / abs(hf64)
    diff = abs(ours - hf32) / abs(hf32)
    tol = 2 * error + 8 * float(np.finfo(np.float32).eps)
    print(f"transformers.AutoModelForCausalLM.from_pretrained({export}): held-out loss over {len(rows)} windows of "
          f"{seq_len} tokens {hf32:.6f}, ours {ours:.6f}: rel diff {diff:.2e} (tol {tol:.2e} = 2 x its float32 error "
          f"vs float64 + 8 ulps)")
    print("PASS" if diff <= tol else "FAIL")
    sys.exit(0 if diff <= tol else 1)


if __name__ == "__main__":
    main()
