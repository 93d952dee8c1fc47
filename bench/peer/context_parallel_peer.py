"""PyTorch 2.15's side of bench/context_parallel's Overhead benchmark: its ring attention
(torch/distributed/tensor/experimental/_context_parallel/_attention.py: _templated_ring_attention
and _templated_ring_attention_backward over the CPU flash kernels, the all-gather rotater, load
balanced) on W Gloo processes with one head of DIM and SEQ tokens head-tail sharded.

Usage: python context_parallel_peer.py --world W --seq SEQ --dim DIM [--calls 200]
After 5 warm-up calls, `calls` forward + backward calls, each after a barrier as the C++ side;
rank 0 prints "PEER <wall seconds per call> <CPU seconds per call>" (means; CPU: this process's,
time.process_time, as Google Benchmark's CPU time on the C++ side).
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

    def call():
        dist.barrier()
        out, lse = A._templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
                                               is_causal=True)
        A._templated_ring_attention_backward(group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward, go,
                                             "grad_out", q, k, v, out, lse, True, dropout_p=0.0)

    for _ in range(5):
        call()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    seconds = (time.perf_counter() - start) / calls
    cpu = (time.process_time() - cpu_start) / calls
    if rank == 0:
        print(f"PEER {seconds} {cpu}", flush=True)
    peer_common.finish_gloo()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    peer_common.spawn(run, args.world, args.seq, args.dim, args.calls)


if __name__ == "__main__":
    main()
