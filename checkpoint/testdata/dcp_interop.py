"""The Python side of //checkpoint:checkpoint_test's interop cases (dcp_test.cc), run with the peer PyTorch.

  dcp_interop.py save DIR REF   torch.distributed.checkpoint.save (one process, no process
                                group) of a state dict with float / bf16 / int64 tensors, a
                                nested dict, a transposed (non-contiguous) tensor, a 0-d and an
                                empty tensor and a non-tensor value into DIR; the same values,
                                under their flattened FQNs, torch.save'd to REF. Prints SAVED.
  dcp_interop.py load DIR REF   dcp.load of the checkpoint C++ wrote into DIR into preallocated
                                (zero) tensors, a nested dict among them, compared exactly with
                                REF (a torch.save-format dict C++ wrote); then the same through
                                format_utils.dcp_to_torch_save. Prints OK.
"""
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

# dcp.save / dcp.load warn that they run without a process group: that is the point here.
warnings.filterwarnings("ignore", category=UserWarning)


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def save(directory, ref):
    torch.manual_seed(0)
    w = torch.randn(5, 7)
    state = {
        "w": w,
        "nested": {"b": torch.randn(6).to(torch.bfloat16), "i": torch.arange(-4, 8, dtype=torch.int64).reshape(3, 4)},
        "t": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "step": 7,
    }
    dcp.save(state, checkpoint_id=directory)
    flat = {"w": w, "nested.b": state["nested"]["b"], "nested.i": state["nested"]["i"],
            "t": state["t"].contiguous(), "scalar": state["scalar"], "empty": state["empty"]}
    torch.save(flat, ref)
    print("SAVED")


def check(loaded, ref, how):
    for key, want in ref.items():
        got = loaded
        for part in key.split("."):
            if part not in got:
                fail(f"{how}: no '{key}'")
            got = got[part]
        if isinstance(want, torch.Tensor):
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                fail(f"{how}: '{key}' is {got!r}, expected {want!r}")
        elif got != want:
            fail(f"{how}: '{key}' is {got!r}, expected {want!r}")


def load(directory, ref_path):
    ref = torch.load(ref_path)  # the default weights_only=True: our writer names no other global
    md = FileSystemReader(directory).read_metadata()
    if not isinstance(md, Metadata) or md.version != "1.0.0" or not all(
            isinstance(md.state_dict_metadata[k], TensorStorageMetadata) for k in ref if k != "step"):
        fail(f"unexpected metadata {md!r}")
    if len(md.state_dict_metadata["w"].chunks) != 4 or len(md.storage_data) != 12 or not all(
            isinstance(info, _StorageInfo) and info.relative_path in ("__0_0.distcp", "__1_0.distcp")
            for info in md.storage_data.values()):
        fail(f"unexpected chunks or storage_data {md!r}")
    # Preallocated destinations; "layer.b" goes in as a nested dict, whose flattened FQN is the
    # key C++ wrote.
    state = {}
    for key, want in ref.items():
        value = torch.zeros_like(want) if isinstance(want, torch.Tensor) else 0
        node = state
        parts = key.split(".") if key.startswith("layer.") else [key]
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    dcp.load(state, checkpoint_id=directory)
    check(state, ref, "dcp.load")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(directory, out)
        full = torch.load(out, weights_only=False)
    flat = {k: full[k] for k in full}
    for key, want in ref.items():
        if key not in flat:
            fail(f"dcp_to_torch_save: no '{key}' in {sorted(flat)}")
        got = flat[key]
        if isinstance(want, torch.Tensor) and not (got.dtype == want.dtype and torch.equal(got, want)):
            fail(f"dcp_to_torch_save: '{key}' is {got!r}, expected {want!r}")
        if not isinstance(want, torch.Tensor) and got != want:
            fail(f"dcp_to_torch_save: '{key}' is {got!r}, expected {want!r}")
    print("OK")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("save", "load"):
        sys.exit(f"usage: {sys.argv[0]} save|load DIR REF")
    (save if sys.argv[1] == "save" else load)(sys.argv[2], sys.argv[3])
