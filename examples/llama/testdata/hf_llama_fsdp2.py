"""Hugging Face's LlamaForCausalLM trained under PyTorch's own FSDP2: the reference of
//examples/llama:llama_parity_test (Fsdp2*) and of the Llama demo (`./x demo`).

Usage: hf_llama_fsdp2.py WORLD STEPS OUT_DIR [ROW_PARTS ...]
WORLD processes (torch.multiprocessing, Gloo, CPU) each build hf_llama_reference.py's model
(same seed: the same weights), fully_shard every decoder layer and then the root
(torch.distributed.fsdp.fully_shard, PyTorch 2.15), and train STEPS steps of AdamW with
torch.nn.utils.clip_grad_norm_ (on FSDP2's DTensor gradients: the global norm), each rank on
its GLOBAL_BATCH / WORLD rows of tokens_for(step, GLOBAL_BATCH). Rank 0 writes (torch.save,
plain dicts of plain tensors):
  OUT_DIR/init.pt       the initial state_dict, HF's keys
  OUT_DIR/hf_init/      the same as save_pretrained writes it (hf_llama_reference.save_hf_init)
  OUT_DIR/reference.pt  "tokens" [STEPS, GLOBAL_BATCH, SEQ]; per step the global loss (the
                        mean of the ranks' equal-sized slice losses) and the total grad norm
                        ("losses", "grad_norms", float64[STEPS]); "final.<fqn>" the full
                        parameters after STEPS steps (get_model_state_dict, full_state_dict);
                        the same under "f64." for the same training in float64 on one process
                        (hf_llama_reference.train, rows split as the ranks split them), and
                        under "rows<k>." in float32 on one process with the rows split in k
                        parts, for k = WORLD and each ROW_PARTS (the world sizes a C++ run
                        compares at): the C++ side derives its tolerances from these.
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
from hf_llama_reference import (LR, WEIGHT_DECAY, build_model, distributed_reference, finish_step,  # noqa: E402
                                save_hf_init, tokens_for, train)

GLOBAL_BATCH = 8  # divisible by 1, 2, 4 and 8


def worker(rank, world, steps, out_dir, store):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = build_model()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   os.path.join(out_dir, "init.pt"))
        save_hf_init(model, out_dir)
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
        finish_step(model, opt, loss, losses, norms)
    final = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(distributed_reference(steps, GLOBAL_BATCH, losses, norms, final), os.path.join(out_dir, "reference.pt"))
        print("losses", losses)
        print("grad_norms", norms)
    dist.barrier()  # both ranks done before either tears its group down (as dcp/testdata/*_interop.py)
    dist.destroy_process_group()


def main():
    if len(sys.argv) < 4:
        sys.exit(f"usage: {sys.argv[0]} WORLD STEPS OUT_DIR [ROW_PARTS ...]")
    world, steps, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    row_parts = [int(a) for a in sys.argv[4:]]
    if any(w < 1 or GLOBAL_BATCH % w != 0 for w in [world, *row_parts]) or steps < 1:
        sys.exit(f"WORLD and ROW_PARTS must divide {GLOBAL_BATCH} and STEPS be positive, got {sys.argv[1:]}")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # fork: the ranks inherit the imported modules (tests/peer/peer_common.py spawn()).
        mp.start_processes(worker, args=(world, steps, out_dir, os.path.join(tmp, "store")), nprocs=world,
                           start_method="fork")
    # The same training in float64 on one process, the batch's rows split as the ranks split
    # them: the f32 run's own rounding error, from which the C++ side derives its tolerance.
    path = os.path.join(out_dir, "reference.pt")
    out = torch.load(path)
    out.update({"f64." + k: v for k, v in train(steps, GLOBAL_BATCH, torch.float64, world).items()})
    # And in f32 on one process with the rows split as W ranks split them, for each W a C++ run
    # compares at against this reference (the demo resumes at another world size): the spread
    # between that run's summation order and this one's.
    for parts in sorted({world, *row_parts}):
        out.update({f"rows{parts}." + k: v for k, v in train(steps, GLOBAL_BATCH, row_parts=parts).items()})
    torch.save(out, path)
    print("OK")


if __name__ == "__main__":
    main()
