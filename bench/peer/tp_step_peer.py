"""PyTorch 2.15's twin of bench/tp's Step benchmark: one training step (forward, backward,
SGD step, zero_grad) of N Linear(8, 8) layers, alternately ColwiseParallel and
RowwiseParallel under parallelize_module (tp) or plain (raw), batch 8, one intra-op thread,
as rank 0 of a tp mesh of 4 on PyTorch's fake process group
(torch.testing._internal.distributed.fake_pg: collectives return at once).

    python tp_step_peer.py BLOCKS[,BLOCKS...] REPETITIONS

Prints one line per block count and side, "PEER <tp|raw> <blocks> <median step seconds>".
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from step_timing import LinearStack, median_step_seconds

TP, DIM, BATCH = 4, 8, 8


def step_seconds(blocks, tp, repetitions, mesh):
    torch.manual_seed(0)
    net = LinearStack(blocks, DIM)
    if tp:
        parallelize_module(net, mesh, {f"l{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                                       for i in range(blocks)})
    return median_step_seconds(net, torch.randn(BATCH, DIM), repetitions)


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
