"""Hugging Face's LlamaForCausalLM under PyTorch 2.15's own 2-D parallelism: tensor parallel
(parallelize_module with torchtitan's Llama plan in HF names, sequence parallel and loss
parallel) on the "tp" dim, then fully_shard per decoder layer and the root on the "dp" dim:
the reference of //examples/llama:llama_parity_test (TwoD*).

Usage: hf_llama_2d.py DP TP STEPS OUT_DIR
DP * TP processes (fork, Gloo, CPU) each build hf_llama_reference.py's model (same seed),
parallelize and shard it, and train STEPS steps of AdamW with clip_grad_norm_, dp rank d on
rows d * B / DP .. of tokens_for(step, GLOBAL_BATCH) (every tp rank of it the same rows).
The whole run is done twice, in float32 and in float64. Rank 0 writes OUT_DIR/init.pt,
OUT_DIR/hf_init/ (as hf_llama_fsdp2.py) and OUT_DIR/reference.pt, of the float32 run: "tokens"; per step the global loss and the total grad norm ("losses",
"grad_norms", float64[STEPS]); "comms.<kind>" int64[STEPS], the collectives of each step's
forward + backward counted by CommDebugMode (kinds as testing/golden/golden_common.py);
"final.<fqn>" the full parameters after STEPS steps; "f64." and "rows<DP>." as
hf_llama_fsdp2.py writes them, "rows<k>." for k = DP, 1 and 4; and "tp64." the losses,
grad_norms and final parameters of the float64 2-D run.

HF's code needs DTensors between the blocks (the sequence length it reads from the
embeddings' shape sizes the rotary table and the causal mask), so the embedding, o_proj and
down_proj keep use_local_output=False; that changes no collective.
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "testing", "golden"))
import golden_common as gc  # noqa: E402
from hf_llama_reference import (LR, WEIGHT_DECAY, build_model, distributed_reference, finish_step,  # noqa: E402
                                save_hf_init, tokens_for, train)

GLOBAL_BATCH = 8
HEADS, KV_HEADS = 8, 4  # llama_training.h TwoDReferenceConfig: whole heads at tp = 4
KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast")


def plan():
    layer = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    out = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                 use_local_output=False),
           "model.norm": SequenceParallel(),
           "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    out.update({f"model.layers.*.{k}": v for k, v in layer.items()})
    return out


def worker(rank, dp, tp, steps, out_dir, store, dtype):
    gc.quiet_torch()
    torch.set_num_threads(1)
    world = dp * tp
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = build_model(HEADS, KV_HEADS).to(dtype)
    if rank == 0 and dtype == torch.float32:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out_dir, "init.pt"))
        save_hf_init(model, out_dir)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    rows = GLOBAL_BATCH // dp
    d = mesh.get_coordinate()[0]
    comm_mode = gc.import_comm_debug_mode()
    losses, norms, comms = [], [], {k: [] for k in KINDS}
    for step in range(steps):
        ids = tokens_for(step, GLOBAL_BATCH)[d * rows:(d + 1) * rows]
        cm = comm_mode()
        with cm, loss_parallel():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        counts = {}
        for op, n in cm.get_comm_counts().items():
            kind = gc.COMM_KINDS.get(str(op).split(".")[-1], str(op))
            counts[kind] = counts.get(kind, 0) + n
        for k in KINDS:
            comms[k].append(counts.get(k, 0))
        finish_step(model, opt, loss, losses, norms)
    final = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        out = distributed_reference(steps, GLOBAL_BATCH, losses, norms, final)
        out.update({"comms." + k: torch.tensor(v, dtype=torch.int64) for k, v in comms.items()})
        torch.save(out, os.path.join(out_dir, f"reference_{str(dtype).split('.')[-1]}.pt"))
        print("losses", losses)
        print("grad_norms", norms)
        print("comms", {k: v[0] for k, v in comms.items()})
    dist.barrier()
    dist.destroy_process_group()


def main():
    if len(sys.argv) != 5:
        sys.exit(f"usage: {sys.argv[0]} DP TP STEPS OUT_DIR")
    dp, tp, steps, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if dp < 1 or tp < 1 or GLOBAL_BATCH % dp != 0 or steps < 1:
        sys.exit(f"DP must divide {GLOBAL_BATCH}, TP and STEPS be positive, got {sys.argv[1:]}")
    os.makedirs(out_dir, exist_ok=True)
    for dtype in (torch.float32, torch.float64):
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(worker, args=(dp, tp, steps, out_dir, os.path.join(tmp, "store"), dtype),
                               nprocs=dp * tp, start_method="fork")
    path = os.path.join(out_dir, "reference.pt")
    out = torch.load(os.path.join(out_dir, "reference_float32.pt"))
    # The same 2-D training in float64 (HF's loss still takes float32 logits): what ours in
    # float64 must match closely, and the f32 run's own rounding error.
    tp64 = torch.load(os.path.join(out_dir, "reference_float64.pt"))
    out.update({"tp64." + k: v for k, v in tp64.items() if k != "tokens" and not k.startswith("comms.")})
    f64 = train(steps, GLOBAL_BATCH, torch.float64, dp, heads=HEADS, kv_heads=KV_HEADS)
    out.update({"f64." + k: v for k, v in f64.items()})
    # The row splits of every dp size a C++ run compares at (it resumes at dp 4 and 1).
    for parts in sorted({dp, 1, 4}):
        rows = train(steps, GLOBAL_BATCH, row_parts=parts, heads=HEADS, kv_heads=KV_HEADS)
        out.update({f"rows{parts}." + k: v for k, v in rows.items()})
    torch.save(out, path)
    print("OK")


if __name__ == "__main__":
    main()
