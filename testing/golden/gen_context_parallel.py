"""Golden ring-attention corpus from real PyTorch on Gloo processes:
torch/distributed/tensor/experimental/_context_parallel/_attention.py.

Run with the peer venv's python (`./x golden` does). Writes

  context_parallel/testdata/golden_ring_attention.txt   read by context_parallel/ring_attention_test.cc

PyTorch's context_parallel() intercepts only the CUDA SDPA kernels, but its ring runs on the
CPU: each case drives _templated_ring_attention and _templated_ring_attention_backward with
aten._scaled_dot_product_flash_attention_for_cpu and its backward on W Gloo processes, each
rank holding its part of the sequence (head-tail chunks r and 2W-1-r of 2W when load balanced,
PyTorch's _cp_options.enable_load_balance; contiguous otherwise), with the rotate method set
as set_rotate_method does.

Records (tab-separated):

  case NAME W CAUSAL BALANCED ROTATE SHAPE KV_HEADS Q K V GRAD_OUT
      the whole-sequence inputs ([batch, heads, seq, head_dim]; k and v with KV_HEADS heads),
      row-major;
  rank NAME R OUT DQ DK DV FORWARD_COMMS BACKWARD_COMMS
      rank R's output and gradients (its part of the sequence) and the collectives of its
      forward and backward as CommDebugMode counts them.

Inputs are seeded; regenerating reproduces the file byte for byte.
"""

import os
import tempfile

import golden_common as gc
import torch

GOLDEN = "context_parallel/testdata/golden_ring_attention.txt"
DOC = __doc__.split("Records (tab-separated):")[1].split("Inputs are seeded")[0]

BATCH, HEADS, SEQ, DIM = 1, 4, 16, 8

# (name, world, causal, balanced, rotate, kv_heads)
CASES = [
    ("causal_balanced_allgather_w2", 2, True, True, "allgather", 4),
    ("causal_balanced_alltoall_w2", 2, True, True, "alltoall", 4),
    ("causal_balanced_allgather_w4", 4, True, True, "allgather", 4),
    ("causal_balanced_alltoall_w4", 4, True, True, "alltoall", 4),
    ("causal_contiguous_alltoall_w4", 4, True, False, "alltoall", 4),
    ("full_allgather_w2", 2, False, False, "allgather", 4),
    ("gqa_causal_balanced_w2", 2, True, True, "allgather", 2),
]


def inputs(index, kv_heads):
    g = torch.Generator().manual_seed(1000 + index)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, generator=g)
    k = torch.randn(BATCH, kv_heads, SEQ, DIM, generator=g)
    v = torch.randn(BATCH, kv_heads, SEQ, DIM, generator=g)
    go = torch.randn(BATCH, HEADS, SEQ, DIM, generator=g)
    return q, k, v, go


def positions(world, rank, balanced):
    if not balanced:
        chunk = SEQ // world
        return list(range(rank * chunk, (rank + 1) * chunk))
    chunk = SEQ // (2 * world)
    tail = 2 * world - 1 - rank
    return list(range(rank * chunk, (rank + 1) * chunk)) + list(range(tail * chunk, (tail + 1) * chunk))


def _rank(rank, world, port, jobs, result_dir):
    import datetime

    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as A

    gc.quiet_torch()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    comm_debug_mode = gc.import_comm_debug_mode()
    aten = torch.ops.aten
    for index, causal, balanced, rotate, full in jobs:
        A._cp_options.enable_load_balance = balanced
        A._cp_options.rotate_method = {"allgather": A._RotateMethod.ALL_GATHER,
                                       "alltoall": A._RotateMethod.ALL_TO_ALL}[rotate]
        idx = torch.tensor(positions(world, rank, balanced))
        q, k, v, go = (t.index_select(2, idx).contiguous() for t in full)
        group = dist.group.WORLD
        with comm_debug_mode() as fwd:
            out, lse = A._templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu,
                                                   q, k, v, is_causal=causal)
        with comm_debug_mode() as bwd:
            dq, dk, dv = A._templated_ring_attention_backward(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward, go, "grad_out", q, k, v, out,
                lse, causal, dropout_p=0.0)[:3]
        result = ("ok", (out, dq, dk, dv), (gc.comm_counts(fwd), gc.comm_counts(bwd)))
        torch.save(result, gc.result_path(result_dir, index, rank))
    dist.destroy_process_group()


def main():
    gc.quiet_torch()
    golden = gc.GoldenFile(GOLDEN, DOC)
    with tempfile.TemporaryDirectory() as result_dir:
        for index, (name, world, causal, balanced, rotate, kv_heads) in enumerate(CASES):
            full = inputs(index, kv_heads)
            gc.run_on_gloo(_rank, world, [(index, causal, balanced, rotate, full)], result_dir)
            q, k, v, go = full
            golden.add("\t".join(["case", name, str(world), str(int(causal)), str(int(balanced)), rotate,
                                  gc.ints(q.shape), str(kv_heads), gc.values(q), gc.values(k), gc.values(v),
                                  gc.values(go)]))
            for rank in range(world):
                status, tensors, comms = torch.load(gc.result_path(result_dir, index, rank), weights_only=False)
                assert status == "ok", (name, rank, status, tensors, comms)
                golden.add("\t".join(["rank", name, str(rank)] + [gc.values(t) for t in tensors] + list(comms)))
            golden.records += 1
    golden.write()


if __name__ == "__main__":
    main()
