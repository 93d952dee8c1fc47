"""PyTorch 2.15's twin of bench/fsdp2's Step benchmark: one training step (forward, backward,
SGD step, zero_grad) of N Linear(4, 4) layers, each fully_shard'ed plus the root (fsdp) or
plain (raw), batch 8, one intra-op thread, as rank 0 of 4 on PyTorch's fake process group
(torch.testing._internal.distributed.fake_pg: collectives return at once without copying).

    python fsdp2_step_peer.py BLOCKS[,BLOCKS...] REPETITIONS

Prints one line per block count and side, "PEER <fsdp|raw> <blocks> <median step seconds>",
taking the median over REPETITIONS timed runs of enough steps for ~0.2 s each.
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD, DIM, BATCH = 4, 4, 8


def step_seconds(blocks, fsdp, repetitions):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(blocks)])
    if fsdp:
        for layer in net:
            fully_shard(layer)
        fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    x = torch.randn(BATCH, DIM)

    def step():
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # lazy init, allocator warm-up
        step()
    t0 = time.perf_counter()
    step()
    steps = max(1, int(0.2 / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(repetitions):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def main():
    block_counts = [int(b) for b in sys.argv[1].split(",")]
    repetitions = int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    for blocks in block_counts:
        for fsdp in (True, False):
            print(f"PEER {'fsdp' if fsdp else 'raw'} {blocks} {step_seconds(blocks, fsdp, repetitions)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
