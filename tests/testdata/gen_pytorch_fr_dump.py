"""Writes pytorch_gloo_fr_dump_rank_{0,1}: PyTorch 2.15's own flight recorder dumps (Gloo,
two ranks) for tests/flight_recorder_test.cc, which reads them with tools/fr_trace_lib.

    python tests/testdata/gen_pytorch_fr_dump.py   (the peer venv's Python; runs both ranks)
"""

import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def rank_main(rank: int, store: str) -> None:
    import torch
    import torch.distributed as dist
    import torch._C._distributed_c10d as c10d

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    x = torch.ones(4, 3)
    dist.all_reduce(x)
    out = torch.empty(8, 3)
    dist.all_gather_into_tensor(out, x)
    sub = dist.new_group([0, 1], group_desc="mesh_dp")
    dist.all_reduce(x.double(), group=sub)
    dist.barrier()
    # No stack traces: they would hold this machine's paths.
    dump = c10d._dump_fr_trace(True, False, False)
    with open(os.path.join(HERE, f"pytorch_gloo_fr_dump_rank_{rank}"), "wb") as f:
        f.write(dump)
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 3:
        rank_main(int(sys.argv[1]), sys.argv[2])
    else:
        store = os.path.join(tempfile.mkdtemp(), "store")
        env = dict(os.environ, TORCH_FR_BUFFER_SIZE="100")
        procs = [subprocess.Popen([sys.executable, __file__, str(r), store], env=env) for r in range(2)]
        sys.exit(max(p.wait() for p in procs))
