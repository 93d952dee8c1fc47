"""PyTorch 2.15's side of bench/pipelining's Overhead benchmarks: its pipeline schedules
(torch.distributed.pipelining) with the same tiny model on the same number of Gloo processes,
or (--backend fake) as the last rank of PyTorch's fake process group of W ranks in this
process, whose sends and receives return at once (what is left is the schedule's host work).

Usage: python pipelining_peer.py --world W [--backend gloo|fake] [--microbatches 16] [--steps 40]
                                 [--schedules GPipe,1F1B]
Every stage is one Linear(1, 1) (weight 0.5, bias 0.1), the batch `microbatches` rows of one
feature, MSE loss against 0.3 x; GPipe and 1F1B one stage per rank, the others two (placement
as the schedule's: loop, or "v" for ZBVZeroBubble and DualPipeV). Per schedule: 3 warm-up
steps, then `steps` steps timed back to back on every rank; rank 0 prints
"PEER <schedule> <wall seconds> <CPU seconds>" per step (means over the steps, as Google
Benchmark reports our side; CPU: this process's, all its threads, time.process_time). "Raw1" / "Raw2": the same stages (1 or 2 per rank, loop placement) written out by hand,
every forward then every backward with blocking recv and isend, as bench/pipelining's raw loop.
A schedule PyTorch fails on prints "PEER <schedule> nan nan" and the error on stderr.
"""
import argparse
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "peer"))
import peer_common  # noqa: E402

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
SINGLE = {"GPipe", "1F1B"}
V_SHAPED = {"ZBVZeroBubble", "DualPipeV"}


def tiny_linear():
    layer = nn.Linear(1, 1)
    with torch.no_grad():
        layer.weight.fill_(0.5)
        layer.bias.fill_(0.1)
    return layer


def stage_rank(name, stage, ranks):
    if name in V_SHAPED:
        turn, pos = divmod(stage, ranks)
        return pos if turn % 2 == 0 else ranks - 1 - pos
    return stage % ranks


def timed(step, steps):
    for _ in range(3):
        step()
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    seconds = ((time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps)
    dist.barrier()
    return seconds


def run_schedule(name, rank, world, m, steps, x, target):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    v = 1 if name in SINGLE else 2
    n = world * v
    # Shapes given, as bench/pipelining gives ours (a fake group cannot infer them).
    stages = [PipelineStage(tiny_linear(), s, n, torch.device("cpu"), input_args=(torch.empty(1, 1),),
                            output_args=(torch.empty(1, 1),))
              for s in range(n) if stage_rank(name, s, world) == rank]
    cls = get_schedule_class(name)
    schedule = cls(stages[0] if name in SINGLE else stages, n_microbatches=m, loss_fn=F.mse_loss)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)

    def step():
        kwargs = {"target": target, "losses": []} if last else {}
        schedule.step(*([x] if first else []), **kwargs)

    return timed(step, steps)


def run_raw(v, rank, world, m, steps, x, target):
    n = world * v
    layers = [tiny_linear() for _ in range(v)]

    def step():
        inputs = [[] for _ in range(v)]
        outputs = [[] for _ in range(v)]
        sends = []
        for c in range(v):
            s = c * world + rank
            for mb in range(m):
                if s == 0:
                    inp = x[mb:mb + 1]
                else:
                    inp = torch.empty(1, 1)
                    dist.recv(inp, (s - 1) % world, tag=2 * s)
                    inp.requires_grad_(True)
                out = layers[c](inp)
                if s == n - 1:
                    out = F.mse_loss(out, target[mb:mb + 1])
                else:
                    sends.append(dist.isend(out.detach(), (s + 1) % world, tag=2 * (s + 1)))
                inputs[c].append(inp)
                outputs[c].append(out)
        for w in sends:
            w.wait()
        sends = []
        for c in reversed(range(v)):
            s = c * world + rank
            for mb in range(m):
                if s == n - 1:
                    outputs[c][mb].backward()
                else:
                    g = torch.empty(1, 1)
                    dist.recv(g, (s + 1) % world, tag=2 * s + 1)
                    outputs[c][mb].backward(g)
                if s > 0:
                    sends.append(dist.isend(inputs[c][mb].grad, (s - 1) % world, tag=2 * (s - 1) + 1))
        for w in sends:
            w.wait()

    return timed(step, steps)


def run(rank, world, init_file, m, steps, schedules, backend="gloo"):
    if backend == "gloo":
        peer_common.init_gloo(rank, world, init_file)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        torch.set_num_threads(1)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    x = torch.linspace(-1, 1, m).reshape(m, 1)
    target = x * 0.3
    results = []
    for v in (1, 2):
        results.append((f"Raw{v}", run_raw(v, rank, world, m, steps, x, target)))
    for name in schedules:
        try:
            results.append((name, run_schedule(name, rank, world, m, steps, x, target)))
        except Exception:  # noqa: BLE001 - reported, the other schedules still run
            if rank == 0:
                traceback.print_exc()
            results.append((name, (float("nan"), float("nan"))))
    if rank == 0 or backend == "fake":
        for name, (wall, cpu) in results:
            print(f"PEER {name} {wall:.9f} {cpu:.9f}", flush=True)
    if backend == "gloo":
        peer_common.finish_gloo()
    else:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--backend", choices=["gloo", "fake"], default="gloo")
    args = parser.parse_args()
    if args.backend == "fake":
        # The last rank: its stages get no gradient from a peer, which PyTorch's single-stage
        # schedules need from a fake receive (they fail on rank 0 with "requires a gradient").
        run(args.world - 1, args.world, None, args.microbatches, args.steps, args.schedules.split(","), "fake")
    else:
        peer_common.spawn(run, args.world, args.microbatches, args.steps, args.schedules.split(","))


if __name__ == "__main__":
    main()
