"""PyTorch 2.15's twin of bench/fsdp2's Step benchmark: one training step (forward, backward,
SGD step, zero_grad) of N Linear(4, 4) layers, each fully_shard'ed plus the root (fsdp) or
plain (raw), batch 8, one intra-op thread, as rank 0 of 4 on PyTorch's fake process group
(torch.testing._internal.distributed.fake_pg: collectives return at once without copying).

    python fsdp2_step_peer.py BLOCKS[,BLOCKS...] REPETITIONS

Prints one line per block count and side, "PEER <fsdp|raw> <blocks> <median step seconds>",
taking the median over REPETITIONS timed runs of enough steps for ~0.2 s each.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from step_timing import median_step_seconds

WORLD, DIM, BATCH = 4, 4, 8


def step_seconds(blocks, fsdp, repetitions):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(blocks)])
    if fsdp:
        for layer in net:
            fully_shard(layer)
        fully_shard(net)
    return median_step_seconds(net, torch.randn(BATCH, DIM), repetitions)


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
