"""PyTorch's FSDP2 / FSDP1 side of bench/e2e: the same models, steps, timing and memory rules.

Usage: python e2e_peer.py --world W --model overhead|compute [--fsdp 2|1] [--steps 20]
Prints one JSON line like bench/e2e_bench (impl "pytorch"; step_ms and memory: compute and
raw communication are the same LibTorch kernels and Gloo collectives as on our side).
--fsdp 2: fully_shard on each block, then the root. --fsdp 1: FullyShardedDataParallel
(FULL_SHARD, flat parameters to the optimizer, PyTorch's defaults otherwise) on each block,
then the root. Memory as bench/e2e_bench.cc: rss_base / rss_peak (before the model / after
the timed steps), alloc_peak / alloc_end (a second model under peer_common.AllocationWindow:
LibTorch CPU allocations since before it was built, peak during 3 steps and live after them).
--device cuda: rank r on cuda:r over NCCL, as bench/e2e_bench --device=cuda (each step ends
with torch.cuda.synchronize(); alloc_peak / alloc_end are -1); --trace PREFIX writes one
profiled step per rank to PREFIX.rank<R>.json (torch.profiler, CPU + CUDA).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

# The helpers the parity tests' peers share (tests/peer/peer_common.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "peer"))
import peer_common  # noqa: E402

SPECS = {"overhead": (64, 64, 8, True), "compute": (4, 1024, 64, False)}


class Block(nn.Module):
    def __init__(self, width, norm):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.ln = nn.LayerNorm(width) if norm else None

    def forward(self, x):
        return x + self.fc(self.ln(x) if self.ln is not None else x).relu()


def build(spec, fsdp, device):
    blocks, width, _, norm = spec
    model = nn.Sequential(*[Block(width, norm) for _ in range(blocks)]).to(device)
    if fsdp == 2:
        from torch.distributed.fsdp import fully_shard
        for b in model:
            fully_shard(b)
        fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        kwargs = dict(sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=device)
        for i in range(blocks):
            model[i] = FSDP(model[i], **kwargs)
        model = FSDP(model, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def max_over_ranks_on(v, device):
    t = torch.tensor([float(v)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run(rank, world, init_file, model_name, fsdp, steps, out, device_type, trace):
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        torch.set_num_threads(1)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    else:
        peer_common.init_gloo(rank, world, init_file)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    spec = SPECS[model_name]
    blocks, width, batch, norm = spec
    x = torch.randn(batch, width).to(device)

    def step(model, opt):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()

    def max_over_ranks(v):
        return max_over_ranks_on(v, device)

    rss_base = max_over_ranks(peer_common.rss_bytes())
    model, opt = build(spec, fsdp, device)
    for _ in range(3):
        step(model, opt)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(model, opt)
        times.append((time.perf_counter() - t0) * 1e3)
    step_ms = max_over_ranks(statistics.median(times))
    rss_peak = max_over_ranks(peer_common.rss_peak_bytes())
    if trace:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            step(model, opt)
        prof.export_chrome_trace(f"{trace}.rank{rank}.json")

    alloc_peak = alloc_end = -1
    if not cuda:
        with peer_common.AllocationWindow() as window:
            mem_model, mem_opt = build(spec, fsdp, device)
            window.mark()
            for _ in range(3):
                step(mem_model, mem_opt)
        alloc_peak, alloc_end = max_over_ranks(window.peak), max_over_ranks(window.current)

    if rank == 0:
        block_numel = width * width + width + (2 * width if norm else 0)
        with open(out, "w") as f:
            json.dump({"impl": "pytorch", "fsdp": fsdp, "model": model_name, "world": world,
                       "params": sum(1 for _ in Block(width, norm).parameters()) * blocks, "step_ms": step_ms,
                       "numel": blocks * block_numel, "group_numel": block_numel,
                       "rss_base": rss_base, "rss_peak": rss_peak,
                       "alloc_peak": alloc_peak, "alloc_end": alloc_end}, f)
    peer_common.finish_gloo()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--model", choices=sorted(SPECS), required=True)
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--trace", default="", help="PREFIX: one profiled step per rank to PREFIX.rank<R>.json")
    args = parser.parse_args()
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"e2e_peer_{os.getpid()}.json")
    peer_common.spawn(run, args.world, args.model, args.fsdp, args.steps, out, args.device, args.trace)
    with open(out) as f:
        print(f.read())
    os.remove(out)


if __name__ == "__main__":
    main()
