"""What the step-benchmark twins share (fsdp2_step_peer.py, tp_step_peer.py, float8_step_peer.py):
the stack of Linears, and the timing loop: three warm-up steps, then the median over REPETITIONS
runs of enough steps for ~0.2 s each."""
import statistics
import time

import torch
import torch.nn as nn


class LinearStack(nn.Module):
    """`blocks` Linear(dim, dim) layers named l0, l1, ... applied in turn (bench/linear_stack.h)."""

    def __init__(self, blocks, dim):
        super().__init__()
        for i in range(blocks):
            self.add_module(f"l{i}", nn.Linear(dim, dim))
        self.blocks = blocks

    def forward(self, x):
        for i in range(self.blocks):
            x = getattr(self, f"l{i}")(x)
        return x


def median_step_seconds(net, x, repetitions):
    """One step is forward, sum, backward, SGD step, zero_grad of `net` on `x`."""
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)

    def step():
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # lazy init, plan caches, allocator warm-up
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
