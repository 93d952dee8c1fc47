"""Hugging Face's LlamaForCausalLM trained under PyTorch's own FSDP2: the reference of
//examples/llama:llama_parity_test (Fsdp2*) and of the Llama demo (`./x demo`).

Usage: hf_llama_fsdp2.py WORLD STEPS OUT_DIR
WORLD processes (torch.multiprocessing, Gloo, CPU) each build hf_llama_reference.py's model
(same seed: the same weights), fully_shard every decoder layer and then the root
(torch.distributed.fsdp.fully_shard, PyTorch 2.15), and train STEPS steps of AdamW with
torch.nn.utils.clip_grad_norm_ (on FSDP2's DTensor gradients: the global norm), each rank on
its GLOBAL_BATCH / WORLD rows of tokens_for(step, GLOBAL_BATCH). Rank 0 writes (torch.save,
plain dicts of plain tensors):
  OUT_DIR/init.pt       the initial state_dict, HF's keys
  OUT_DIR/reference.pt  "tokens" [STEPS, GLOBAL_BATCH, SEQ]; per step the global loss (the
                        mean of the ranks' equal-sized slice losses) and the total grad norm
                        ("losses", "grad_norms", float64[STEPS]); "final.<fqn>" the full
                        parameters after STEPS steps (get_model_state_dict, full_state_dict).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_llama_reference import LR, MAX_NORM, WEIGHT_DECAY, build_model, tokens_for  # noqa: E402

GLOBAL_BATCH = 8  # divisible by 1, 2, 4 and 8


def worker(rank, world, steps, out_dir, store):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = build_model()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   os.path.join(out_dir, "init.pt"))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    rows = GLOBAL_BATCH // world
    losses, norms = [], []
    for step in range(steps):
        ids = tokens_for(step, GLOBAL_BATCH)[rank * rows:(rank + 1) * rows]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        norms.append(norm.item())
    final = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        out = {"tokens": torch.stack([tokens_for(s, GLOBAL_BATCH) for s in range(steps)]),
               "losses": torch.tensor(losses, dtype=torch.float64),
               "grad_norms": torch.tensor(norms, dtype=torch.float64)}
        out.update({"final." + k: v.detach().clone() for k, v in final.items()})
        torch.save(out, os.path.join(out_dir, "reference.pt"))
        print("losses", losses)
        print("grad_norms", norms)
    dist.barrier()  # both ranks done before either tears its group down (as dcp/testdata/*_interop.py)
    dist.destroy_process_group()


def main():
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} WORLD STEPS OUT_DIR")
    world, steps, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if world < 1 or GLOBAL_BATCH % world != 0 or steps < 1:
        sys.exit(f"WORLD must divide {GLOBAL_BATCH} and STEPS be positive, got {world}, {steps}")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, steps, out_dir, os.path.join(tmp, "store")), nprocs=world)
    print("OK")


if __name__ == "__main__":
    main()
