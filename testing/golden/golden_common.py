"""Shared helpers of the golden-corpus generators (testing/golden/gen_*.py).

The generators run real PyTorch (the pinned version, from the peer venv that `./x setup`
installs) on the CPU and write line-oriented text files that the C++ tests parse with
absl::StrSplit / SimpleAtoi / SimpleAtod. Conventions every golden file follows:

  * line 1 is `# torch <torch.__version__>`: the PyTorch that produced the file;
  * further lines starting with `#` document the format and are skipped by the parsers;
  * a record is one line of space-separated tokens, its first token the record kind;
  * an integer list is one token, comma-separated (`5,0,7`), `-` when empty (a 0-D shape,
    a shard with no elements);
  * placements are one token each, PyTorch's own short `str()` without spaces:
    `S(0)`, `_S(0,2)` (_StridedShard(dim=0, split_factor=2)), `R`, `P(sum)`, `P(avg)`.

Regenerating must reproduce the files byte for byte: the inputs are integer-valued, the
sampling uses a fixed random.Random, and nothing depends on dict order or time.
"""

import contextlib
import io
import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist

# Where the generators write: paths in the files and in `./x golden` are repo-relative.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Files above this size are reported: they make the repository and the test slow.
MAX_FILE_BYTES = 2 * 1024 * 1024


def quiet_torch():
    """Silences the warnings PyTorch prints while simulating ranks (missing NumPy, the
    "flatten mesh dimensions" hint of torch/distributed/tensor/_redistribute.py): they are
    not part of the corpus and would interleave with the generator's own output."""
    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


def import_comm_debug_mode():
    """CommDebugMode from torch/distributed/tensor/debug/_comm_mode.py.

    The package's __init__ also imports the sharding visualizer, which needs NumPy, and
    the peer venv installs torch without it. The submodule itself needs only torch, and
    it stays in sys.modules when the package import fails half way, so take it from there.
    """
    try:
        from torch.distributed.tensor.debug import CommDebugMode

        return CommDebugMode
    except ImportError:
        return sys.modules["torch.distributed.tensor.debug._comm_mode"].CommDebugMode


COMM_KINDS = {  # CommDebugMode's op names -> the golden file's kinds
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "shard_dim_alltoall": "all_to_all",
    "broadcast": "broadcast",
}


def comm_counts(mode):
    counts = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        kind = COMM_KINDS.get(name, name)
        counts[kind] = counts.get(kind, 0) + n
    return " ".join(f"{k}={counts[k]}" for k in sorted(counts) if counts[k]) or "-"


@contextlib.contextmanager
def simulated_world(world_size):
    """All `world_size` ranks in this process: PyTorch's fake process group (the default
    group, so init_device_mesh works) under LocalTensorMode
    (torch/distributed/_local_tensor/__init__.py), which runs every op once per rank and
    carries out the collectives across the simulated ranks. Yields the mode; its
    rank_map builds per-rank tensors. The same set-up as LocalDTensorTestBase in
    torch/testing/_internal/distributed/_tensor/common_dtensor.py."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        with LocalTensorMode(frozenset(range(world_size))) as mode:
            yield mode
    finally:
        dist.destroy_process_group()


def rank_tensor(local, rank):
    """Rank `rank`'s tensor of a LocalTensor (or the tensor itself when every rank holds
    the same plain tensor)."""
    if hasattr(local, "trigger_wait"):  # an AsyncCollectiveTensor (a style's async_op output)
        local = local.trigger_wait()
    tensors = getattr(local, "_local_tensors", None)
    return tensors[rank] if tensors is not None else local


def placement_token(p):
    """The one place that names placements in the golden files (the C++ side maps the same
    tokens to fsdp::dtensor::Placement in one function): PyTorch's short str()
    (torch/distributed/tensor/placement_types.py) without spaces."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    if isinstance(p, _StridedShard):  # checked first: the class hierarchy may change
        return f"_S({p.dim},{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    raise ValueError(f"no golden token for placement {p!r}")


def ints(values):
    """`1,2,3`; `-` for an empty list."""
    values = [int(v) for v in values]
    return ",".join(str(v) for v in values) if values else "-"


def number(v):
    """A value exactly: integers without a fraction, others as Python's shortest
    round-trip repr (absl::SimpleAtod reads it back to the same double)."""
    v = float(v)
    return str(int(v)) if v.is_integer() else repr(v)


def values(tensor):
    """A tensor's elements in row-major order, comma-separated; `-` when empty."""
    flat = tensor.detach().contiguous().view(-1).tolist()
    return ",".join(number(v) for v in flat) if flat else "-"


def one_line(text, limit=120):
    """An exception message squeezed into one token-safe line (the rest of a record)."""
    text = " ".join(str(text).split())
    return text[:limit] if text else "-"


class GoldenFile:
    """Collects the lines of one golden file and writes it atomically."""

    def __init__(self, rel_path, doc):
        self.rel_path = rel_path
        self.lines = [f"# torch {torch.__version__}"]
        self.lines += [("# " + line).rstrip() for line in doc.strip("\n").splitlines()]
        self.records = 0

    def add(self, line):
        self.lines.append(line)

    def write(self):
        path = os.path.join(REPO_ROOT, self.rel_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        text = "\n".join(self.lines) + "\n"
        tmp = path + ".tmp"
        with io.open(tmp, "w", encoding="ascii", newline="\n") as f:
            f.write(text)
        os.replace(tmp, path)
        size = len(text.encode("ascii"))
        note = "  (over the size budget of %d bytes)" % MAX_FILE_BYTES if size > MAX_FILE_BYTES else ""
        print(f"wrote {self.rel_path}: {self.records} cases, {size} bytes{note}")
        return size


def result_path(result_dir, index, rank):
    """Where a rank of run_on_gloo saves the outcome of job `index` (torch.save)."""
    return os.path.join(result_dir, f"{index}.{rank}.pt")


def run_on_gloo(rank_fn, world, jobs, result_dir, stall_s=90):
    """Runs rank_fn(rank, world, port, jobs, result_dir) in `world` processes (real ranks,
    Gloo over 127.0.0.1). Each job's first element is its index; rank_fn saves every job's
    outcome to result_path() as soon as it has it. A job that makes no progress for stall_s
    seconds (PyTorch deadlocks when ranks take different paths) or kills a rank (Gloo aborts
    on mismatched collectives) gets the outcome ("hang" / "crash", "", ""); the processes
    are replaced and the jobs after it run on."""
    import socket
    import time

    import torch.multiprocessing as tmp

    def finished(j):
        return all(os.path.exists(result_path(result_dir, jobs[j][0], r)) for r in range(world))

    start = 0
    while start < len(jobs):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = tmp.start_processes(rank_fn, args=(world, port, jobs[start:], result_dir), nprocs=world, join=False)
        done, last, since = -1, start, time.time()
        while True:
            try:
                if ctx.join(timeout=5):
                    break
                failure = "hang"
            except Exception:
                failure = "crash"
            while last < len(jobs) and finished(last):
                last, since = last + 1, time.time()
            if failure == "crash" or time.time() - since > stall_s:
                for p in ctx.processes:
                    p.kill()
                    p.join()
                for r in range(world):
                    torch.save((failure, "", ""), result_path(result_dir, jobs[last][0], r))
                done = last
                break
        start = done + 1 if done >= 0 else len(jobs)
