"""The Python side of //dcp:interop_test's Hugging Face cases, run with the peer venv (PyTorch
2.15, safetensors 0.8, huggingface_hub): the model is fsdp2_interop.py's InteropNet with its
sin / cos weights (init_weights), the same on both sides.

  hf_interop.py check DIR SHARD_SIZE DTYPE
      DIR is C++'s SaveHuggingFace export of the model (DTYPE: float32 or bfloat16, files
      split at SHARD_SIZE bytes). Checks: safetensors.torch.load_file reads every file and
      they hold init_weights' tensors (converted to DTYPE); huggingface_hub's
      split_torch_state_dict_into_shards gives the same files, and save_file of each file's
      tensors with metadata={"format": "pt"} (what save_pretrained writes) is byte for byte
      the file; the index maps every key to its file; dcp.load with PyTorch's
      HuggingFaceStorageReader reads the consolidated files and the per-rank files of
      DIR/sharded to the same values. Prints OK.
  hf_interop.py save DIR
      PyTorch FSDP2 on 2 forked processes (Gloo, a FileStore) saves the model with
      HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True), fc2 and the
      buffer in a second file. Prints SAVED.
"""
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp2_interop import InteropNet, fail, init_weights  # noqa: E402

WORLD = 2


def reference(dtype):
    model = InteropNet()
    init_weights(model)
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in model.state_dict().items()}


def check(directory, shard_size, dtype_name):
    import json
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import load_file, save

    want = reference(getattr(torch, dtype_name))
    split = split_torch_state_dict_into_shards(want, max_shard_size=shard_size,
                                               filename_pattern="model{suffix}.safetensors")
    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
    ours = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not split.is_sharded:  # huggingface_hub names a single file model.safetensors; PyTorch's
        split.filename_to_tensors = {"model-00001-of-00001.safetensors": list(want)}  # consolidation does not
    if ours != sorted(split.filename_to_tensors):
        fail(f"files {ours}, huggingface_hub splits into {sorted(split.filename_to_tensors)}")
    for name, keys in split.filename_to_tensors.items():
        path = os.path.join(directory, name)
        got = load_file(path)
        if sorted(got) != sorted(keys):
            fail(f"{name} holds {sorted(got)}, expected {sorted(keys)}")
        for k in keys:
            if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k]):
                fail(f"{name}: {k} is {got[k]!r}, expected {want[k]!r}")
            if index["weight_map"].get(k) != name:
                fail(f"the index puts {k} in {index['weight_map'].get(k)}, not {name}")
        with open(path, "rb") as f:
            if f.read() != save({k: want[k] for k in keys}, metadata={"format": "pt"}):
                fail(f"{name} is not the bytes safetensors' save writes for its tensors")
    if sorted(index["weight_map"]) != sorted(want):
        fail(f"the index maps {sorted(index['weight_map'])}, the model has {sorted(want)}")
    size = sum(t.numel() * t.element_size() for t in want.values())
    if index["metadata"]["total_size"] != size:
        fail(f"total_size {index['metadata']['total_size']}, the tensors hold {size} bytes")
    for where in (directory, os.path.join(directory, "sharded")):
        state = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(state, storage_reader=HuggingFaceStorageReader(where))
        for k, v in want.items():
            if not torch.equal(state[k], v):
                fail(f"HuggingFaceStorageReader({where}) reads {k} as {state[k]!r}, expected {v!r}")


def run_save(rank, directory):
    mesh = init_device_mesh("cpu", (WORLD,))
    model = InteropNet()
    init_weights(model)
    fully_shard(model.fc0, mesh=mesh)
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = get_model_state_dict(model)
    mapping = {k: 2 if k.startswith("fc2") or k == "scale" else 1 for k in state}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(directory, fqn_to_index_mapping=mapping,
                                                            save_distributed=True, enable_consolidation=True))


def worker(rank, store, directory):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    run_save(rank, directory)
    dist.barrier()
    dist.destroy_process_group()


def main():
    warnings.filterwarnings("ignore")
    if len(sys.argv) == 5 and sys.argv[1] == "check":
        check(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        print("OK")
    elif len(sys.argv) == 3 and sys.argv[1] == "save":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(worker, args=(os.path.join(tmp, "store"), sys.argv[2]), nprocs=WORLD,
                               start_method="fork")
        print("SAVED")
    else:
        sys.exit(f"usage: {sys.argv[0]} check DIR SHARD_SIZE DTYPE | save DIR")


if __name__ == "__main__":
    main()
