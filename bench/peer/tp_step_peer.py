"""PyTorch 2.15's twin of bench/tp's Step benchmark: one training step (forward, backward,
SGD step, zero_grad) of N Linear(8, 8) layers, alternately ColwiseParallel and
RowwiseParallel under parallelize_module (tp) or plain (raw), batch 8, one intra-op thread,
as rank 0 of a tp mesh of 4 on PyTorch's fake process group
(torch.testing._internal.distributed.fake_pg: collectives return at once).

    python tp_step_peer.py BLOCKS[,BLOCKS...] REPETITIONS

Prints one line per block count and side, "PEER <tp|raw> <blocks> <median step seconds>".
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

TP, DIM, BATCH = 4, 8, 8


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        for i in range(blocks):
            self.add_module(f"l{i}", nn.Linear(DIM, DIM))
        self.blocks = blocks

    def forward(self, x):
        for i in range(self.blocks):
            x = getattr(self, f"l{i}")(x)
        return x


def step_seconds(blocks, tp, repetitions, mesh):
    torch.manual_seed(0)
    net = Stack(blocks)
    if tp:
        parallelize_module(net, mesh, {f"l{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                                       for i in range(blocks)})
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    x = torch.randn(BATCH, DIM)

    def step():
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
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
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    mesh = init_device_mesh("cpu", (TP,))
    for blocks in block_counts:
        for tp in (True, False):
            print(f"PEER {'tp' if tp else 'raw'} {blocks} {step_seconds(blocks, tp, repetitions, mesh)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
