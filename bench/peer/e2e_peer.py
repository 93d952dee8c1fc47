"""PyTorch's FSDP2 side of bench/e2e: the same models, steps and timing rule.

Usage: python e2e_peer.py --world W --model overhead|compute [--steps 20]
Prints one JSON line like bench/e2e_bench (impl "pytorch"; step_ms only: compute and raw
communication are the same LibTorch kernels and Gloo collectives as on our side).
"""
import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

SPECS = {"overhead": (64, 64, 8, True), "compute": (4, 1024, 64, False)}


class Block(nn.Module):
    def __init__(self, width, norm):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.ln = nn.LayerNorm(width) if norm else None

    def forward(self, x):
        return x + self.fc(self.ln(x) if self.ln is not None else x).relu()


def run(rank, world, init_file, model_name, steps, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    blocks, width, batch, norm = SPECS[model_name]
    model = nn.Sequential(*[Block(width, norm) for _ in range(blocks)])
    for b in model:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"impl": "pytorch", "model": model_name, "world": world,
                       "params": sum(1 for _ in model.parameters()), "step_ms": med.item()}, f)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--model", choices=sorted(SPECS), required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.spawn(run, args=(args.world, os.path.join(d, "init"), args.model, args.steps, out), nprocs=args.world)
        with open(out) as f:
            print(f.read())


if __name__ == "__main__":
    main()
