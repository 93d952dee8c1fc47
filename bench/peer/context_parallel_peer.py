"""PyTorch 2.15's side of bench/context_parallel's Overhead benchmark: its ring attention
(torch/distributed/tensor/experimental/_context_parallel/_attention.py: _templated_ring_attention
and _templated_ring_attention_backward over the CPU flash kernels, the all-gather rotater, load
balanced) with one head of DIM and SEQ tokens head-tail sharded: on W Gloo processes, or
(--backend fake) as rank 0 of PyTorch's fake process group of W ranks in this process, whose
collectives return at once (the ring's host work and kernels alone).

Usage: python context_parallel_peer.py --backend gloo|fake --world W --seq SEQ --dim DIM [--calls N]
After warm-up calls, `calls` forward + backward calls (default 200 on Gloo, 2000 fake), each
after a barrier as the C++ side; rank 0 prints "PEER <wall seconds per call> <CPU seconds per
call> <kernel CPU seconds per call>" (means; CPU: this process's, time.process_time; kernels:
the flash kernel calls the ring made on rank 0, with their shapes, timed alone).
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "peer"))
import peer_common  # noqa: E402


def run(rank, world, init_file, seq, dim, calls):
    if init_file is None:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    else:
        peer_common.init_gloo(rank, world, init_file)
    from torch.distributed.tensor.experimental._context_parallel import _attention as A

    A._cp_options.enable_load_balance = True
    A._cp_options.rotate_method = A._RotateMethod.ALL_GATHER
    aten = torch.ops.aten
    chunk = seq // (2 * world)
    idx = torch.tensor(list(range(rank * chunk, (rank + 1) * chunk)) +
                       list(range((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)))
    q, k, v, go = (torch.randn(1, 1, seq, dim).index_select(2, idx).contiguous() for _ in range(4))
    group = dist.group.WORLD
    kernel_calls = []

    def recording(op):
        def run_op(*args, **kwargs):
            kernel_calls.append((op, args, kwargs))
            return op(*args, **kwargs)
        return run_op

    def call(forward_op=aten._scaled_dot_product_flash_attention_for_cpu,
             backward_op=aten._scaled_dot_product_flash_attention_for_cpu_backward):
        dist.barrier()
        out, lse = A._templated_ring_attention(group, 2, forward_op, q, k, v, is_causal=True)
        A._templated_ring_attention_backward(group, 2, backward_op, go, "grad_out", q, k, v, out, lse, True,
                                             dropout_p=0.0)

    for _ in range(max(5, calls // 10)):
        call()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    seconds = (time.perf_counter() - start) / calls
    cpu = (time.process_time() - cpu_start) / calls
    call(recording(aten._scaled_dot_product_flash_attention_for_cpu),
         recording(aten._scaled_dot_product_flash_attention_for_cpu_backward))
    start = time.process_time()
    for _ in range(calls):
        for op, args, kwargs in kernel_calls:
            op(*args, **kwargs)
    kernels = (time.process_time() - start) / calls
    if rank == 0:
        print(f"PEER {seconds} {cpu} {kernels}", flush=True)
    if init_file is None:
        dist.destroy_process_group()
    else:
        peer_common.finish_gloo()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--backend", choices=["gloo", "fake"], default="gloo")
    parser.add_argument("--calls", type=int)
    args = parser.parse_args()
    if args.backend == "fake":
        torch.set_num_threads(1)  # as each C++ rank
        run(0, args.world, None, args.seq, args.dim, args.calls or 2000)
    else:
        peer_common.spawn(run, args.world, args.seq, args.dim, args.calls or 200)


if __name__ == "__main__":
    main()
