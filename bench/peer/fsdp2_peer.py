"""PyTorch's own FSDP2 on the same model, weights, data and steps as a C++ run.

Usage: python fsdp2_peer.py --world W --input in.pt --output out.pt
  in.pt  (written by the C++ side): "param/<fqn>" initial full parameters, "x/<step>" and
         "y/<step>" the global batches, "steps" and "lr" as 1-element tensors.
  out.pt (read by the C++ side): "param/<fqn>", "exp_avg/<fqn>", "exp_avg_sq/<fqn>" full
         tensors after training, "step/<fqn>" the AdamW step count.
The model mirrors fsdp/per_param/test_models.h (NetImpl with two blocks): fully_shard on each
block, then on the root; gloo on CPU; each rank trains on its rows of the global batch.
"""
import argparse
import os
import tempfile

import torch
import torch.jit._pickle
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, blocks=2, hidden=7):
        super().__init__()
        # The C++ names: "in" is a Python keyword, hence add_module / getattr.
        self.extra = nn.Parameter(torch.zeros(6))
        self.add_module("in", nn.Linear(3, 5))
        self.head = nn.Linear(5, 1)
        self.blocks = []
        for i in range(blocks):
            b = Block(5, hidden)
            self.add_module(f"block{i}", b)
            self.blocks.append(b)

    def forward(self, x):
        h = getattr(self, "in")(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h) + self.extra.sum()


def run(rank, world, init_file, inp, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    # torch::pickle_save tags dict types with restore_type_tag; allow just that global.
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        data = torch.load(inp)
    steps, lr = int(data["steps"].item()), float(data["lr"].item())
    model = Net()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(data[f"param/{name}"])
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = data[f"x/{step}"], data[f"y/{step}"]
        local = x.shape[0] // world
        rows = slice(rank * local, (rank + 1) * local)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    result = {}
    for name, p in model.named_parameters():
        result[f"param/{name}"] = p.full_tensor().detach().clone()
        state = opt.state[p]
        result[f"exp_avg/{name}"] = state["exp_avg"].full_tensor().clone()
        result[f"exp_avg_sq/{name}"] = state["exp_avg_sq"].full_tensor().clone()
        result[f"step/{name}"] = torch.tensor([float(state["step"])])
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run, args=(args.world, os.path.join(d, "init"), args.input, args.output), nprocs=args.world)


if __name__ == "__main__":
    main()
