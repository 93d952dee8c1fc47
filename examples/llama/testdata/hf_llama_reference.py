"""Hugging Face reference for //examples/llama:llama_parity_test.

Reference: transformers 5.24.0 (pip-installed into the peer venv next to torch 2.15.0),
transformers/models/llama/modeling_llama.py (LlamaForCausalLM) and
transformers/loss/loss_utils.py (ForCausalLMLoss: labels shifted left, last position ignored).

Usage: hf_llama_reference.py OUT_DIR
Writes, with torch.save (plain dicts of plain tensors, which our validating reader,
checkpoint::LoadTensorDict, accepts):
  OUT_DIR/init.pt       the initial state_dict, HF's own keys (model.layers.0.self_attn.q_proj.weight, ...)
  OUT_DIR/reference.pt  tokens [K, B, T] (int64); step 0's logits, loss and every parameter's
                        gradient ("grad.<fqn>", before clipping); per step k = 0..K-1 the loss
                        and the total grad norm clip_grad_norm_ returns ("losses", "grad_norms",
                        float64[K]); the parameters after K AdamW steps ("final.<fqn>").
The config and training constants are mirrored in llama_parity_test.cc (kConfig, kLr, ...).
"""
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 32, 64, 2, 4, 2
ROPE_THETA, RMS_EPS = 500000.0, 1e-5  # not the defaults, so both are really plumbed through
STEPS, BATCH, SEQ = 5, 4, 12
LR, WEIGHT_DECAY, MAX_NORM = 1e-2, 0.1, 1.0


def tokens_for(step, batch=BATCH):
    # Deterministic ids from a formula (no RNG), saved so the C++ side uses the same.
    b = torch.arange(batch).view(-1, 1)
    t = torch.arange(SEQ).view(1, -1)
    return (step * 7 + b * 13 + t * 5 + (b * t) % 3) % VOCAB


def build_model():
    """The tiny random LlamaForCausalLM both references train (seeded: the same on every rank)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=64, rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        attn_implementation="eager")  # the plain matmul/softmax path the C++ model follows
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        # HF initializes RMSNorm weights to ones; perturb them so the weight * normalized
        # product (and where eps sits) is actually tested.
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.add_(0.1 * torch.randn_like(p))
    model.train()  # dropout is 0.0 anyway
    return model


def main(out_dir):
    model = build_model()
    os.makedirs(out_dir, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               os.path.join(out_dir, "init.pt"))

    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    out = {"tokens": torch.stack([tokens_for(s) for s in range(STEPS)])}
    losses, norms = [], []
    for step in range(STEPS):
        ids = tokens_for(step)
        result = model(input_ids=ids, labels=ids)
        opt.zero_grad()
        result.loss.backward()
        if step == 0:
            out["logits0"] = result.logits.detach().clone()
            out["loss0"] = result.loss.detach().clone()
            for name, p in params.items():
                out["grad." + name] = p.grad.detach().clone()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(result.loss.item())
        norms.append(norm.item())
    out["losses"] = torch.tensor(losses, dtype=torch.float64)
    out["grad_norms"] = torch.tensor(norms, dtype=torch.float64)
    for name, p in params.items():
        out["final." + name] = p.detach().clone()
    torch.save(out, os.path.join(out_dir, "reference.pt"))
    print("losses", losses)
    print("grad_norms", norms)


if __name__ == "__main__":
    main(sys.argv[1])
