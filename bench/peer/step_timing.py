"""The timing loop the step-benchmark twins share (fsdp2_step_peer.py, tp_step_peer.py):
three warm-up steps, then the median over REPETITIONS runs of enough steps for ~0.2 s each."""
import statistics
import time

import torch


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
