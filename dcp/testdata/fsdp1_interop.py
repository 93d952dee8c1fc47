"""The Python side of //dcp:interop_test (fsdp1_interop_test.cc), run with the peer PyTorch (2.15): PyTorch's own
FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel, FULL_SHARD, CPU, Gloo) on 2 processes
and torch.distributed.checkpoint with torch/distributed/checkpoint/state_dict.py's default
(sharded) get/set_model_state_dict and get/set_optimizer_state_dict. Processes, rendezvous,
init, data and the training loop are fsdp2_interop.py's (imported from it), so both sides of
both interop tests compute the same thing.

The model is the C++ test's Fsdp1Net, with the same FQNs: inp = Linear(4, 5),
block0 / block1 = Block(5, 7) (fc1 = Linear(5, 7), fc2 = Linear(7, 5), a residual), head =
Linear(5, 2), a buffer `scale`. Each Block is its own FSDP unit (ModuleWrapPolicy), the root
holds inp and head. Flat parameters of 82 and 37 elements shard unevenly at W=3 and W=2, so
the C++ checkpoint's chunks are boxes cut mid-row while PyTorch's FSDP1 reads and writes dim-0
chunks of each original parameter (ShardedTensor; torch/distributed/fsdp/_state_dict_utils.py
_sharded_post_state_dict_hook, _optim_utils.py _optim_state_dict).

use_orig_params=False, as the C++ side (its optimizer holds the flat parameters): PyTorch's
FSDP.optim_state_dict / optim_state_dict_to_load, which get/set_optimizer_state_dict call,
unflatten and flatten the flat parameters' state by FQN (torch/distributed/fsdp/
_optim_utils.py); `load` checks use_orig_params=True as well (the same keys and values).

  fsdp1_interop.py load DIR REF   dcp.load the checkpoint C++ saved (model + AdamW at W=3),
                                  with use_orig_params False and True; the full tensors must
                                  equal REF (C++'s torch.save-format dict under the flattened
                                  DCP keys), and the .metadata keys and global shapes must be
                                  exactly those Python's own dcp.save writes. Prints OK.
  fsdp1_interop.py train DIR OUT  AdamW(lr=1e-2) 5 steps, dcp.save into DIR, 5 more steps;
                                  torch.save's OUT = {"losses": float64[5] of steps 5-9,
                                  "<fqn>": the final full parameters}. Prints SAVED.
"""
import faulthandler
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp2_interop import WORLD, fail, init_weights, train

LR = 1e-2


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Fsdp1Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.block0 = Block(5, 7)
        self.block1 = Block(5, 7)
        self.head = nn.Linear(5, 2)
        self.register_buffer("scale", torch.tensor([1.0, 0.5]))

    def forward(self, x):
        return self.head(torch.relu(self.block1(self.block0(self.inp(x))))) * self.scale


def build(lr, use_orig_params=False):
    model = Fsdp1Net()
    init_weights(model)  # before wrapping: named_parameters() order, as the C++ side
    # device_id: without it FSDP1 refuses a CPU-only host ("FSDP needs a non-CPU accelerator
    # device", torch/distributed/fsdp/_init_utils.py _init_device_handle).
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.FULL_SHARD,
                 use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def sharded_state(model, opt):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def check_load(rank, directory, ref, use_orig_params):
    where = f"rank {rank}, use_orig_params={use_orig_params}"
    model, opt = build(lr=0.5, use_orig_params=use_orig_params)  # the checkpoint's lr must replace 0.5
    state = sharded_state(model, opt)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    full = StateDictOptions(full_state_dict=True)
    model_sd = get_model_state_dict(model, options=full)
    optim_sd = get_optimizer_state_dict(model, opt, options=full)
    checked = 0
    for key, want in ref.items():
        parts = key.split(".")
        if parts[0] == "model":
            got = model_sd[key[len("model."):]]
        elif parts[:2] == ["optim", "state"]:
            got = optim_sd["state"][".".join(parts[2:-1])][parts[-1]]
        elif key == "optim.param_groups.0.lr":
            got = torch.tensor(optim_sd["param_groups"][0]["lr"], dtype=torch.float64)
        else:
            fail(f"unexpected reference key {key}")
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            fail(f"{where}: {key} is {got!r}, C++ saved {want!r}")
        checked += 1
    if checked != len(ref) or checked < 40:
        fail(f"{where}: checked only {checked} values")
    # The keys and global shapes C++ wrote are exactly those Python's dcp.save writes.
    with tempfile.TemporaryDirectory() as tmp:
        obj = [os.path.join(tmp, "py") if rank == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        dcp.save(sharded_state(model, opt), checkpoint_id=obj[0])
        if rank == 0:
            mine = FileSystemReader(directory).read_metadata().state_dict_metadata
            theirs = FileSystemReader(obj[0]).read_metadata().state_dict_metadata
            if sorted(mine) != sorted(theirs):
                fail(f"{where}: C++ keys {sorted(mine)} != Python keys {sorted(theirs)}")
            for key, md in theirs.items():
                if type(md) is not type(mine[key]) or getattr(md, "size", None) != getattr(mine[key], "size", None):
                    fail(f"{where}: {key}: C++ wrote {mine[key]!r}, Python writes {md!r}")
        dist.barrier()
    train(model, opt, 3, 1, rank)  # and it trains on


def run_load(rank, directory, ref_path):
    ref = torch.load(ref_path, weights_only=False)
    # Both of FSDP1's optimizer-state paths (torch/distributed/fsdp/_optim_utils.py): the
    # flat parameters' state unflattened by FQN (use_orig_params=False, as the C++ side), and
    # the original parameters' flat-shard pieces (use_orig_params=True).
    for use_orig_params in (False, True):
        check_load(rank, directory, ref, use_orig_params)


def run_train(rank, directory, out):
    model, opt = build(lr=LR)
    train(model, opt, 0, 5, rank)
    dcp.save(sharded_state(model, opt), checkpoint_id=directory)
    losses = train(model, opt, 5, 5, rank)
    params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        result = {"losses": torch.tensor(losses, dtype=torch.float64)}
        # FSDP1's full state dict tensors carry a `_has_been_cloned` attribute
        # (torch/distributed/fsdp/_state_dict_utils.py, _full_post_state_dict_hook),
        # which torch.save pickles with _rebuild_from_type_v2, a global the C++ reader
        # refuses; clones are plain tensors.
        result.update({k: v.detach().clone() for k, v in params.items() if k != "scale"})
        torch.save(result, out)


def worker(rank, store, mode, directory, path):
    faulthandler.enable()  # a crash in the C++ below prints where Python was
    warnings.filterwarnings("ignore")  # FSDP1's deprecation and CPU-device warnings
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    (run_load if mode == "load" else run_train)(rank, directory, path)
    dist.barrier()  # both ranks done before either tears its group down
    dist.destroy_process_group()


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("load", "train"):
        sys.exit(f"usage: {sys.argv[0]} load|train DIR PATH")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        # fork: the ranks inherit the imported modules (tests/peer/peer_common.py spawn()).
        mp.start_processes(worker, args=(os.path.join(tmp, "store"), sys.argv[1], sys.argv[2], sys.argv[3]), nprocs=WORLD,
                           start_method="fork")
    print("OK" if sys.argv[1] == "load" else "SAVED")


if __name__ == "__main__":
    main()
