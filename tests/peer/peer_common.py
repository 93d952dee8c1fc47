"""Helpers shared by the PyTorch peer scripts (fsdp1_peer.py, fsdp2_peer.py, e2e_peer.py).

- spawn(fn, world, *args): runs fn(rank, world, init_file, *args) on `world` forked processes
  (torch.multiprocessing), with a fresh FileStore rendezvous file; init_gloo() joins it.
- The parity model (Net / Block), mirroring fsdp/common/test_models.h, and the exchange with
  the C++ side through torch pickle files: load_input(), build_net(), train(), save_result().
- Memory: rss_bytes() / rss_peak_bytes() (this process), AllocationWindow (the peak of
  LibTorch's CPU allocations in a region, from the profiler's memory events: the same c10
  counter metrics/allocation_window.h reads on the C++ side) and owned_bytes() (distinct storages of
  parameters and optimizer state).
"""
import os
import resource
import tempfile

import torch
import torch.distributed as dist
import torch.jit._pickle
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


def spawn(fn, world, *args):
    with tempfile.TemporaryDirectory() as d:
        # fork: the ranks inherit the imported torch (spawn would import it once per rank,
        # seconds each). Nothing before this runs ATen, so no thread pool is forked.
        mp.start_processes(fn, args=(world, os.path.join(d, "init"), *args), nprocs=world,
                           start_method="fork")


def init_gloo(rank, world, init_file):
    torch.set_num_threads(1)  # the W processes share the machine's cores, as the C++ side
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def finish_gloo():
    """Leaves the group together: a rank tearing Gloo down while a peer still finishes its
    last collective (or writes the result) sometimes aborted in c10d ("terminate called
    without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- parity model and exchange
class Block(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):
    """fsdp/common/test_models.h's NetImplT (two blocks, hidden 7), with the C++ names."""

    def __init__(self, blocks=2, hidden=7):
        super().__init__()
        self.num_blocks = blocks
        self.extra = nn.Parameter(torch.zeros(6))
        self.add_module("in", nn.Linear(3, 5))  # "in" is a Python keyword: add_module / getattr
        self.head = nn.Linear(5, 1)
        for i in range(blocks):
            self.add_module(f"block{i}", Block(5, hidden))

    def blocks(self):
        # By name, not a list: FSDP1's wrapping replaces the attributes.
        return [getattr(self, f"block{i}") for i in range(self.num_blocks)]

    def forward(self, x):
        h = getattr(self, "in")(x)
        for b in self.blocks():
            h = b(h)
        return self.head(h) + self.extra.sum()


def load_input(path):
    """in.pt written by the C++ side: "param/<fqn>", "x/<step>", "y/<step>", "steps", "lr"."""
    return torch.load(path)  # the default weights_only=True (checkpoint/checkpoint_writer.h)


def build_net(data):
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(data[f"param/{name}"])
    return model


def train(model, opt, data, rank, world):
    """data["steps"] AdamW steps of MSE regression, each rank on its rows of the batch."""
    for step in range(int(data["steps"].item())):
        x, y = data[f"x/{step}"], data[f"y/{step}"]
        local = x.shape[0] // world
        rows = slice(rank * local, (rank + 1) * local)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def save_result(path, params, states):
    """out.pt read by the C++ side: params {fqn: full tensor}, states {fqn: AdamW state}."""
    result = {}
    for fqn, p in params.items():
        result[f"param/{fqn}"] = p.detach().clone()
        state = states[fqn]
        for name in ("exp_avg", "exp_avg_sq"):
            result[f"{name}/{fqn}"] = state[name].detach().clone()
        result[f"step/{fqn}"] = torch.tensor([float(state["step"])])
    torch.save(result, path)


# ---------------------------------------------------------------- memory
def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class AllocationWindow:
    """LibTorch CPU allocations made inside the `with` block, as metrics/allocation_window.h counts them.

    While memory profiling is on, c10's CPU allocator reports every allocation and free with
    its running total of the bytes allocated since profiling started and not yet freed.
    `peak`: the largest total after mark() (or the start); `current`: the total at the end.
    The total covers every thread (c10's caffe2_report_cpu_memory_usage flag, set here as
    metrics/allocation_window.cc sets it): the profiler alone counts only this thread's frees, so
    memory freed on a backend's thread would count as live forever.
    """

    _SENTINEL = 987_653  # bytes of the marker allocation that mark() makes and frees

    @staticmethod
    def _set_all_threads(on):
        import ctypes
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = on

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile
        self._set_all_threads(True)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def mark(self):
        torch.empty(self._SENTINEL, dtype=torch.uint8)  # freed at once

    def __exit__(self, *exc):
        from torch._C._profiler import _EventType
        self._prof.__exit__(*exc)
        self._set_all_threads(False)
        events, stack = [], list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
            stack.extend(node.children)
        events.sort(key=lambda e: e[0])
        start = next((i + 1 for i, e in enumerate(events) if e[1] == -self._SENTINEL), 0)
        after = events[start:] or events[-1:]
        self.peak = max((e[2] for e in after), default=0)
        self.current = events[-1][2] if events else 0
        return False


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def owned_bytes(params, opt):
    """Bytes of the distinct storages of `params`, their gradients and the optimizer state."""
    seen, total = set(), 0
    tensors = []
    for p in params:
        tensors.append(_local(p))
        if p.grad is not None:
            tensors.append(_local(p.grad))
        tensors.extend(_local(v) for v in opt.state.get(p, {}).values() if torch.is_tensor(v))
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes() > 0:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total
