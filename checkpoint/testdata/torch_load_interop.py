"""The Python side of //checkpoint:checkpoint_test's interop case, run with the peer PyTorch.

  torch_load_interop.py OURS BACK   torch.load(OURS) with torch.load's defaults (weights_only=True:
                                    only torch/_weights_only_unpickler.py's allowed globals), and
                                    again with mmap=True; the two must agree, the views in OURS
                                    must share their storage as saved, and the value is
                                    torch.save'd to BACK for the C++ side to compare with what it
                                    wrote. Prints OK.
"""
import sys

import torch


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def same(a, b, at):
    if type(a) is not type(b):
        fail(f"{at}: {type(a).__name__} vs {type(b).__name__}")
    if isinstance(a, torch.Tensor):
        if (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) != (
                b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad) or not torch.equal(a, b):
            fail(f"{at}: {a!r} vs {b!r}")
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            fail(f"{at}: {len(a)} vs {len(b)} items")
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{at}[{i}]")
    elif isinstance(a, dict):
        if list(a) != list(b):
            fail(f"{at}: keys {list(a)} vs {list(b)}")
        for k in a:
            same(a[k], b[k], f"{at}[{k!r}]")
    elif a != b:
        fail(f"{at}: {a!r} vs {b!r}")


def main(ours, back):
    value = torch.load(ours)  # no weights_only argument: the default, True
    same(value, torch.load(ours, mmap=True), "mmap")
    if value["view"].untyped_storage().data_ptr() != value["t"].untyped_storage().data_ptr():
        fail("'view' and 't' no longer share their storage")
    torch.save(value, back)
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
