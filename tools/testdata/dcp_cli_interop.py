"""The Python side of //tools:dcp_cli_test, run with the peer PyTorch.

  dcp_cli_interop.py save DIR REF ORIG  torch.distributed.checkpoint.save (one process, no
                                        process group) of a {"model", "optim", "extra"} state
                                        dict into DIR; format_utils.dcp_to_torch_save(DIR) to
                                        REF; the state dict itself torch.save'd to ORIG.
                                        Prints SAVED.
  dcp_cli_interop.py save-sharded DIR REF
                                        the same from two gloo ranks (a FileStore rendezvous,
                                        no TCP port), the "model" and "optim" tensors as DTensors
                                        sharded on dim 0 (several chunks, two files); rank 0
                                        then writes REF with dcp_to_torch_save. Prints SAVED.
  dcp_cli_interop.py compare GOT WANT   torch.load both (GOT with the default weights_only=True)
                                        and compare them exactly: the same nesting, dict key
                                        order, value types and values, tensors bit for bit.
                                        Prints OK.
  dcp_cli_interop.py check-dcp DIR ORIG the checkpoint `dcp from-torch ORIG DIR` wrote: its
                                        metadata matches what format_utils.torch_save_to_dcp
                                        writes for ORIG (keys in order, kinds, dtypes, sizes,
                                        planner_data); dcp.load into a zeroed template of ORIG
                                        and dcp_to_torch_save(DIR) both give ORIG back (as DCP
                                        nests it: str dict keys). Prints OK.
"""
import os
import sys
import tempfile
import warnings
from collections.abc import Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

# dcp.save / dcp.load warn that they run without a process group: that is the point here.
warnings.filterwarnings("ignore", category=UserWarning)


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def state_dict():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    special = torch.tensor([float("nan"), float("inf"), -0.0, 1.5])
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {
            "bf16": torch.randn(6).to(torch.bfloat16),
            "ints": torch.arange(-4, 8, dtype=torch.int64).reshape(3, 4),
            "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 3),
            "flags": torch.tensor([True, False, True]),
            "complex": torch.randn(2, dtype=torch.complex64),
            "special": special,
            "mixed": [torch.ones(2, dtype=torch.float16), 5, "x", {"deep": torch.full((2,), 3)}],
            "pair": (torch.arange(3), "a"),
            "names": ["w", "b"],
            "big": 1 << 40,
            "neg": -7,
            "none": None,
            "text": "caf\u00e9",
        },
    }


def save(directory, ref, orig):
    state = state_dict()
    dcp.save(state, checkpoint_id=directory)
    dcp_to_torch_save(directory, ref)
    torch.save(state, orig)
    print("SAVED")


def sharded_worker(rank, store, directory):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    state = state_dict()  # the same values on both ranks (seeded)

    def shard(value):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return distribute_tensor(value, mesh, [Shard(0)])
        if isinstance(value, Mapping):
            return {k: shard(v) for k, v in value.items()}
        return value

    state["model"], state["optim"] = shard(state["model"]), shard(state["optim"])
    dcp.save(state, checkpoint_id=directory)
    # Both ranks leave together, with nothing left to do: a rank tearing Gloo down while its
    # peer still worked (rank 0 wrote REF here) sometimes aborted the peer in c10d ("terminate
    # called without an active exception"); as tests/peer/peer_common.py.
    dist.barrier()
    dist.destroy_process_group()


def save_sharded(directory, ref):
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        # fork: the ranks inherit the imported modules (tests/peer/peer_common.py spawn()).
        mp.start_processes(sharded_worker, args=(os.path.join(tmp, "store"), directory), nprocs=2,
                           start_method="fork")
    dcp_to_torch_save(directory, ref)  # one process, no group: after both ranks are gone
    print("SAVED")


def same(got, want, where):
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            fail(f"{where}: {type(got).__name__}, expected a tensor")
        if got.dtype != want.dtype or got.shape != want.shape:
            fail(f"{where}: {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}")
        g, w = got.detach().contiguous().reshape(-1), want.detach().contiguous().reshape(-1)
        if not torch.equal(g.view(torch.uint8), w.view(torch.uint8)):
            fail(f"{where}: {got!r}, expected {want!r}")
    elif isinstance(want, Mapping):
        if not isinstance(got, Mapping) or list(got.keys()) != list(want.keys()):
            fail(f"{where}: keys {list(got.keys()) if isinstance(got, Mapping) else got!r}, "
                 f"expected {list(want.keys())}")
        for key in want:
            same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            fail(f"{where}: {got!r}, expected {want!r}")
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{where}[{i}]")
    elif type(got) is not type(want) or got != want:
        fail(f"{where}: {got!r} ({type(got).__name__}), expected {want!r} ({type(want).__name__})")


def compare(got_path, want_path):
    got = torch.load(got_path)  # the default weights_only=True: no arbitrary globals
    want = torch.load(want_path)
    same(got, want, "root")
    print("OK")


def described(md):
    out = []
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            out.append((key, "tensor", entry.properties.dtype, tuple(entry.size),
                        [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]))
        else:
            out.append((key, "bytes"))
    return out, md.planner_data


def check_dcp(directory, orig_path):
    # What DCP gives back for ORIG: the nesting rebuilt from the flattened keys' object paths
    # (dict keys become str, e.g. the optimizer's int param ids).
    flat, mappings = flatten_state_dict(torch.load(orig_path))
    orig = unflatten_state_dict(flat, mappings)
    ours = FileSystemReader(directory).read_metadata()
    with tempfile.TemporaryDirectory() as tmp:
        torch_save_to_dcp(orig_path, os.path.join(tmp, "py"))
        theirs = FileSystemReader(os.path.join(tmp, "py")).read_metadata()
        if described(ours) != described(theirs):
            fail(f"metadata {described(ours)}\nexpected {described(theirs)}")
        # dcp.load into a template: zeroed tensors, None for every other value.
        template = {}
        for key, value in flat.items():
            set_element(template, mappings[key],
                        torch.zeros_like(value) if isinstance(value, torch.Tensor) else None)
        dcp.load(template, checkpoint_id=directory)
        same(template, orig, "dcp.load")
        dcp_to_torch_save(directory, os.path.join(tmp, "full.pt"))
        same(torch.load(os.path.join(tmp, "full.pt")), orig, "dcp_to_torch_save")
    print("OK")


if __name__ == "__main__":
    commands = {"save": (save, 3), "save-sharded": (save_sharded, 2), "compare": (compare, 2),
                "check-dcp": (check_dcp, 2)}
    if len(sys.argv) < 2 or sys.argv[1] not in commands or len(sys.argv) != 2 + commands[sys.argv[1]][1]:
        fail(f"usage: {__doc__}")
    commands[sys.argv[1]][0](*sys.argv[2:])
