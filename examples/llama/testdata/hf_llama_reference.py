"""Hugging Face reference for //examples/llama:llama_parity_test.

Reference: transformers 5.24.0 (pip-installed into the peer venv next to torch 2.15.0),
transformers/models/llama/modeling_llama.py (LlamaForCausalLM) and
transformers/loss/loss_utils.py (ForCausalLMLoss: labels shifted left, last position ignored).

Usage: hf_llama_reference.py OUT_DIR
Writes, with torch.save (plain dicts of plain tensors, which our validating reader,
checkpoint::LoadTensorDict, accepts):
  OUT_DIR/init.pt       the initial state_dict, HF's own keys (model.layers.0.self_attn.q_proj.weight, ...)
  OUT_DIR/hf_init/      the same model as save_pretrained writes it (config.json and the weights
                        split at 20KB into model-0000i-of-0000N.safetensors + the index), what
                        the C++ FSDP runs load (dcp::LoadHuggingFace)
  OUT_DIR/reference.pt  tokens [K, B, T] (int64); step 0's logits, loss and every parameter's
                        gradient ("grad.<fqn>", before clipping); per step k = 0..K-1 the loss
                        and the total grad norm clip_grad_norm_ returns ("losses", "grad_norms",
                        float64[K]); the parameters after K AdamW steps ("final.<fqn>");
                        the same keys under "f64." for the same training in float64 (the
                        reference's own f32 rounding error: the test's tolerances derive from
                        it), and under "rows<k>." (k = 1, 2) the losses, norms and final
                        parameters of the f32 training with each batch's rows split in k parts
                        whose mean losses are averaged by gradient accumulation (FSDP at W=k's
                        order).
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


def build_model(heads=HEADS, kv_heads=KV_HEADS):
    """The tiny random LlamaForCausalLM the references train (seeded: the same on every rank);
    hf_llama_2d.py gives 8 and 4 heads, so that tensor parallelism over 4 ranks keeps whole heads."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=heads, num_key_value_heads=kv_heads,
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


def train(steps, batch, dtype=torch.float32, row_parts=1, record_step0=False, heads=HEADS, kv_heads=KV_HEADS):
    """`steps` AdamW + clip_grad_norm_ steps of build_model() in `dtype` on tokens_for(step, batch).

    Each batch's rows are split into `row_parts` equal parts (as FSDP's ranks split them) whose
    mean losses are averaged by gradient accumulation: the same gradient as the whole batch's
    mean loss, summed in the order FSDP at W=row_parts sums it. Returns the reference.pt keys
    (losses, grad_norms, final.<fqn>; with record_step0 also logits0, loss0, grad.<fqn>).
    """
    model = build_model(heads, kv_heads).to(dtype)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    out, losses, norms = {}, [], []
    for step in range(steps):
        opt.zero_grad()
        loss = 0.0
        for ids in tokens_for(step, batch).chunk(row_parts):
            result = model(input_ids=ids, labels=ids)
            (result.loss / row_parts).backward()
            loss += result.loss.item() / row_parts
            if step == 0 and record_step0:
                out["logits0"] = result.logits.detach().clone()
                out["loss0"] = result.loss.detach().clone()
        if step == 0 and record_step0:
            for name, p in params.items():
                out["grad." + name] = p.grad.detach().clone()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(loss)
        norms.append(norm.item())
    out["losses"] = torch.tensor(losses, dtype=torch.float64)
    out["grad_norms"] = torch.tensor(norms, dtype=torch.float64)
    for name, p in params.items():
        out["final." + name] = p.detach().clone()
    return out



def finish_step(model, opt, loss, losses, norms):
    """A distributed rank's end of a step: clip_grad_norm_ (on DTensor gradients: the global
    norm), the AdamW step, zero_grad; appends the global loss (the mean of every rank's,
    which for tensor-parallel ranks of one batch slice is that slice's) and the norm."""
    import torch.distributed as dist

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    opt.step()
    opt.zero_grad()
    total = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().clone()
    dist.all_reduce(total)
    losses.append(total.item() / dist.get_world_size())
    norms.append(norm.item())


def distributed_reference(steps, global_batch, losses, norms, final):
    """The reference.pt keys of a distributed run: its tokens, per-step losses and grad norms,
    and the final full state dict."""
    out = {"tokens": torch.stack([tokens_for(s, global_batch) for s in range(steps)]),
           "losses": torch.tensor(losses, dtype=torch.float64),
           "grad_norms": torch.tensor(norms, dtype=torch.float64)}
    out.update({"final." + k: v.detach().clone() for k, v in final.items()})
    return out

def save_hf_init(model, out_dir):
    """`model` as save_pretrained writes it, in several files (max_shard_size) and an index."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model.save_pretrained(os.path.join(out_dir, "hf_init"), max_shard_size="20KB")


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    model = build_model()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out_dir, "init.pt"))
    save_hf_init(model, out_dir)
    out = {"tokens": torch.stack([tokens_for(s) for s in range(STEPS)])}
    out.update(train(STEPS, BATCH, record_step0=True))
    out.update({"f64." + k: v for k, v in train(STEPS, BATCH, torch.float64, record_step0=True).items()})
    for parts in (1, 2):  # rows1: the same run again (the same order; C++ one process uses it)
        out.update({f"rows{parts}." + k: v for k, v in train(STEPS, BATCH, row_parts=parts).items()})
    torch.save(out, os.path.join(out_dir, "reference.pt"))
    print("losses", out["losses"].tolist())
    print("grad_norms", out["grad_norms"].tolist())


if __name__ == "__main__":
    main(sys.argv[1])
