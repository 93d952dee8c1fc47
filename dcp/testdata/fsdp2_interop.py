"""The Python side of //dcp:interop_test, run with the peer PyTorch (2.15): PyTorch's own
FSDP2 (torch.distributed.fsdp.fully_shard) on 2 CPU processes (forked by torch.multiprocessing,
Gloo on 127.0.0.1; the rendezvous is a FileStore, so no TCP port is picked and then raced
for by other tests) and torch.distributed.checkpoint.

The model is the C++ test's InteropNet, with the same FQNs: fc0 = Linear(4, 8),
fc1 = Linear(8, 8), fc2 = Linear(8, 2), a buffer `scale`; fully_shard on fc0, fc1, then the
root. Weights and data come from sin / cos formulas (no RNG), the same on both sides.

  fsdp2_interop.py load DIR REF   dcp.load the checkpoint C++ saved (model + AdamW + a Stateful at W=4)
                                  through get/set_model_state_dict and
                                  get/set_optimizer_state_dict; the full tensors must equal
                                  REF (C++'s torch.save-format dict under the flattened DCP
                                  keys), the options C++'s; and the .metadata keys must be
                                  exactly those Python's own dcp.save writes. Prints OK.
  fsdp2_interop.py train DIR OUT  AdamW(lr=1e-2) 5 steps, dcp.save into DIR, 5 more steps;
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
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

WORLD = 2
LR = 1e-2
BATCH = 12


class InteropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(4, 8)
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 2)
        self.register_buffer("scale", torch.tensor([1.0, 0.5]))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.fc0(x))))) * self.scale


def init_weights(model):
    # Parameter k (named_parameters order): sin(0.7 * i + k) * 0.3 over its elements.
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.copy_((torch.sin(torch.arange(p.numel(), dtype=torch.float32) * 0.7 + k) * 0.3).reshape(p.shape))


def batch(step):
    x = torch.sin(torch.arange(BATCH * 4, dtype=torch.float32) * 0.1 + step).reshape(BATCH, 4)
    y = torch.cos(torch.arange(BATCH * 2, dtype=torch.float32) * 0.05 + 0.5 * step).reshape(BATCH, 2)
    return x, y


def build(lr):
    mesh = init_device_mesh("cpu", (WORLD,))
    model = InteropNet()
    init_weights(model)
    fully_shard(model.fc0, mesh=mesh)
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def train(model, opt, first, steps, rank):
    rows = BATCH // WORLD
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    return losses


def fail(msg):
    raise SystemExit(f"FAIL: {msg}")


def train_state(step):
    """A training loop's own state, every kind of leaf (C++: interop_test.cc's TrainState)."""
    return {"step": torch.tensor(step, dtype=torch.int64), "epoch": step, "name": f"python {step}",
            "lrs": [0.1 * step], "done": step > 0,
            "loader": {"windows": 10 * step, "rng": [torch.arange(3, dtype=torch.float32) * step]}}


class TrainStateful(Stateful):
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def same_state(got, want):
    if isinstance(want, dict):
        return isinstance(got, dict) and sorted(got) == sorted(want) and all(same_state(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same_state, got, want))
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    return type(got) is type(want) and got == want


def run_load(rank, directory, ref_path):
    model, opt = build(lr=0.5)  # the checkpoint's lr must replace this
    # A training loop's own state rides along as a Stateful (C++: SaveOptions::stateful).
    train_stateful = TrainStateful(train_state(-1))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
             "train": train_stateful}
    dcp.load(state, checkpoint_id=directory)
    if not same_state(train_stateful.state, train_state(3)):
        fail(f"rank {rank}: train loaded as {train_stateful.state!r}, C++ saved {train_state(3)!r}")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    ref = torch.load(ref_path, weights_only=False)
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
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            fail(f"rank {rank}: {key} is {got!r}, C++ saved {want!r}")
        checked += 1
    if checked != len(ref) or checked < 20:
        fail(f"checked only {checked} values")
    # The keys C++ wrote are exactly the ones Python's dcp.save writes for this model.
    with tempfile.TemporaryDirectory() as tmp:
        py_dir = os.path.join(tmp, "py") if rank == 0 else None
        obj = [py_dir]
        dist.broadcast_object_list(obj, src=0)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                  "train": TrainStateful(train_state(3))}, checkpoint_id=obj[0])
        if rank == 0:
            mine = FileSystemReader(directory).read_metadata().state_dict_metadata
            theirs = FileSystemReader(obj[0]).read_metadata().state_dict_metadata
            if sorted(mine) != sorted(theirs):
                fail(f"C++ keys {sorted(mine)} != Python keys {sorted(theirs)}")
            for key, md in theirs.items():
                if type(md) is not type(mine[key]) or getattr(md, "size", None) != getattr(mine[key], "size", None):
                    fail(f"{key}: C++ wrote {mine[key]!r}, Python writes {md!r}")
        dist.barrier()
    train(model, opt, 3, 1, rank)  # and it trains on


def run_train(rank, directory, out):
    model, opt = build(lr=LR)
    train(model, opt, 0, 5, rank)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
              "train": TrainStateful(train_state(5))}, checkpoint_id=directory)
    losses = train(model, opt, 5, 5, rank)
    params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        result = {"losses": torch.tensor(losses, dtype=torch.float64)}
        result.update({k: v for k, v in params.items() if k != "scale"})
        torch.save(result, out)


def worker(rank, store, mode, directory, path):
    faulthandler.enable()  # a crash in the C++ below prints where Python was
    warnings.filterwarnings("ignore")
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
