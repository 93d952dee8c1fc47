"""PyTorch 2.15's side of bench/pipelining's Overhead benchmarks: its pipeline schedules
(torch.distributed.pipelining) with the same tiny model on the same number of Gloo processes,
or (--backend fake) as the last rank of PyTorch's fake process group of W ranks in this
process, whose sends and receives return at once (what is left is the schedule's host work).

Usage: python pipelining_peer.py --world W [--backend gloo|fake] [--microbatches 16] [--steps 40]
                                 [--schedules GPipe,1F1B] [--callgrind]
Every stage is one Linear(1, 1) (weight 0.5, bias 0.1), the batch `microbatches` rows of one
feature, MSE loss against 0.3 x; GPipe and 1F1B one stage per rank, the others two (placement
as the schedule's: loop, or "v" for ZBVZeroBubble and DualPipeV). Per schedule: 3 warm-up
steps, then `steps` steps timed back to back on every rank; rank 0 prints
"PEER <schedule> <wall seconds> <CPU seconds>" per step (means over the steps, as Google
Benchmark reports our side; CPU: this process's, all its threads, time.process_time). "Raw1" / "Raw2": the same stages (1 or 2 per rank, loop placement) written out by hand,
every forward then every backward with blocking recv and isend, as bench/pipelining's raw loop;
"Raw2Split": Raw2 with each backward split as bench/pipelining's (the input's gradient with
torch.autograd.grad retaining the graph, every weight gradient after all of them).
A schedule PyTorch fails on prints "PEER <schedule> nan nan" and the error on stderr.

--callgrind (under `valgrind --tool=callgrind --instr-atstart=no`, tools/callgrind_pipelining.sh):
instead of timing, each loop runs CALLGRIND_STEPS[0] then CALLGRIND_STEPS[1] steps with
instrumentation on, each run dumped as "<name>/pytorch/<microbatches> iters=<steps>"
(callgrind_control from this process, so the dumps' difference cancels what the toggling
costs), as bench/pipelining's --callgrind dumps ours. "Raw2V" / "Raw2VSplit": the raw loops
in the V placement of ZBVZeroBubble and DualPipeV, as bench/pipelining's.
"""
import argparse
import gc
import os
import subprocess
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


CALLGRIND_STEPS = (2, 6)
CALLGRIND = {"on": False, "microbatches": 0}


def callgrind_control(*args):
    subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, stdout=subprocess.DEVNULL)


def counted(name, step):
    """Under --callgrind: instrumented runs of `step`, one dump per run. Each starts after a
    garbage collection (uncounted), so that a collection of all of PyTorch's objects, which
    some run would otherwise meet by chance, does not land in one of the two runs."""
    callgrind_control("--instr=on")
    for steps in CALLGRIND_STEPS:
        gc.collect()
        callgrind_control("--zero")
        for _ in range(steps):
            step()
        callgrind_control(f"--dump={name}/pytorch/{CALLGRIND['microbatches']} iters={steps}")
    callgrind_control("--instr=off")
    return float("nan"), float("nan")


def timed(step, steps, name):
    for _ in range(3):
        step()
    dist.barrier()
    if CALLGRIND["on"]:
        return counted(name, step)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    seconds = ((time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps)
    dist.barrier()
    return seconds


def run_schedule(name, rank, world, m, steps, x, target, fake):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    v = 1 if name in SINGLE else 2
    n = world * v
    # On a fake group shapes given, as bench/pipelining gives ours (it cannot infer them). On
    # Gloo inferred at the first (warm-up) step: given there, PyTorch 2.15's GPipe fails on
    # rank 0 ("A GradientEdge root requires a gradient but got <class 'NoneType'>").
    shapes = {"input_args": (torch.empty(1, 1),), "output_args": (torch.empty(1, 1),)} if fake else {}
    stages = [PipelineStage(tiny_linear(), s, n, torch.device("cpu"), **shapes)
              for s in range(n) if stage_rank(name, s, world) == rank]
    cls = get_schedule_class(name)
    schedule = cls(stages[0] if name in SINGLE else stages, n_microbatches=m, loss_fn=F.mse_loss)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)

    def step():
        kwargs = {"target": target, "losses": []} if last else {}
        schedule.step(*([x] if first else []), **kwargs)

    return timed(step, steps, name)


def run_raw(v, rank, world, m, steps, x, target, v_shaped=False, split=False):
    n = world * v
    layers = [tiny_linear() for _ in range(v)]

    def stage_of(c):
        return 2 * world - 1 - rank if v_shaped and c == 1 else c * world + rank

    def rank_of(s):
        return 2 * world - 1 - s if v_shaped and s >= world else s % world

    def step():
        inputs = [[] for _ in range(v)]
        outputs = [[] for _ in range(v)]
        handed = [None] * m  # per microbatch, between this rank's two stages
        sends = []
        for c in range(v):
            s = stage_of(c)
            for mb in range(m):
                if s == 0:
                    inp = x[mb:mb + 1]
                elif rank_of(s - 1) == rank:
                    inp = handed[mb].requires_grad_(True)
                else:
                    inp = torch.empty(1, 1)
                    dist.recv(inp, rank_of(s - 1), tag=2 * s)
                    inp.requires_grad_(True)
                out = layers[c](inp)
                if s == n - 1:
                    out = F.mse_loss(out, target[mb:mb + 1])
                elif rank_of(s + 1) == rank:
                    handed[mb] = out.detach()
                else:
                    sends.append(dist.isend(out.detach(), rank_of(s + 1), tag=2 * (s + 1)))
                inputs[c].append(inp)
                outputs[c].append(out)
        for w in sends:
            w.wait()
        sends = []
        output_grads = [[] for _ in range(v)]
        for c in reversed(range(v)):
            s = stage_of(c)
            for mb in range(m):
                g = None
                if s < n - 1 and rank_of(s + 1) == rank:
                    g = handed[mb]
                elif s < n - 1:
                    g = torch.empty(1, 1)
                    dist.recv(g, rank_of(s + 1), tag=2 * s + 1)
                if not split:
                    outputs[c][mb].backward(g)
                elif s > 0:
                    inputs[c][mb].grad, = torch.autograd.grad(outputs[c][mb], inputs[c][mb], g, retain_graph=True)
                if s > 0 and rank_of(s - 1) == rank:
                    handed[mb] = inputs[c][mb].grad
                elif s > 0:
                    sends.append(dist.isend(inputs[c][mb].grad, rank_of(s - 1), tag=2 * (s - 1) + 1))
                output_grads[c].append(g)
        for c in reversed(range(v)) if split else ():
            params = None if stage_of(c) == 0 else list(layers[c].parameters())
            for mb in range(m):
                torch.autograd.backward(outputs[c][mb], output_grads[c][mb], inputs=params)
        for w in sends:
            w.wait()

    name = f"Raw{v}{'V' if v_shaped else ''}{'Split' if split else ''}"
    return name, timed(step, steps, name)


RAW_LOOPS = [(1, False, False), (2, False, False), (2, False, True), (2, True, False), (2, True, True)]


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
    for v, v_shaped, split in RAW_LOOPS:
        results.append(run_raw(v, rank, world, m, steps, x, target, v_shaped, split))
    for name in schedules:
        try:
            results.append((name, run_schedule(name, rank, world, m, steps, x, target, backend == "fake")))
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
    parser.add_argument("--callgrind", action="store_true")
    args = parser.parse_args()
    if args.callgrind and args.backend != "fake":
        parser.error("--callgrind counts one process: it needs --backend fake")
    CALLGRIND.update(on=args.callgrind, microbatches=args.microbatches)
    if args.backend == "fake":
        # The last rank: its stages get no gradient from a peer, which PyTorch's single-stage
        # schedules need from a fake receive (they fail on rank 0 with "requires a gradient").
        run(args.world - 1, args.world, None, args.microbatches, args.steps, args.schedules.split(","), "fake")
    else:
        peer_common.spawn(run, args.world, args.microbatches, args.steps, args.schedules.split(","))


if __name__ == "__main__":
    main()
