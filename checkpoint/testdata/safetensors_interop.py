"""The Python side of //checkpoint:checkpoint_test's safetensors interop cases
(safetensors_test.cc), run with the peer PyTorch and its safetensors package.

  safetensors_interop.py write DIR   safetensors.torch.save_file of the test tensors (every
                                     dtype, empty and 0-d tensors, an odd name) with metadata
                                     {"format": "pt"} to DIR/python.safetensors, and of two
                                     tensors with three metadata keys to
                                     DIR/python_meta.safetensors. Prints WROTE.
  safetensors_interop.py check DIR   DIR/cpp.safetensors and DIR/cpp_meta.safetensors, which C++
                                     wrote from the same tensors: load_file reads equal values
                                     and metadata, and save_file of the same tensors writes the
                                     same bytes (for cpp_meta, the same header JSON and data:
                                     Python writes several metadata keys in its hash map's
                                     order, which changes from run to run). Prints IDENTICAL.

The tensors are the C++ test's: TestTensors() there builds the same (name, dtype, shape) list
and the same values, small integers and halves that every dtype holds exactly.
"""
import json
import os
import struct
import sys
import tempfile

import safetensors
import torch
from safetensors.torch import load_file, save_file

ODD_NAME = 'odd "name"\\ \u00e9\U0001F600 \x01\n'
SPECS = [
    ("f64", torch.float64, [2, 3]), ("f32", torch.float32, [4, 5]), ("f16", torch.float16, [3, 2]),
    ("bf16", torch.bfloat16, [7]), ("i64", torch.int64, [2, 2]), ("i32", torch.int32, [5]),
    ("i16", torch.int16, [3]), ("i8", torch.int8, [4]), ("u8", torch.uint8, [6]),
    ("bool", torch.bool, [2, 2, 2]), ("u16", torch.uint16, [3]), ("u32", torch.uint32, [3]),
    ("u64", torch.uint64, [2]), ("f8_e4m3", torch.float8_e4m3fn, [5]), ("f8_e5m2", torch.float8_e5m2, [5]),
    ("f8_e4m3fnuz", torch.float8_e4m3fnuz, [4]), ("f8_e5m2fnuz", torch.float8_e5m2fnuz, [4]),
    ("f8_e8m0", torch.float8_e8m0fnu, [6]), ("c64", torch.complex64, [3]),
    ("empty", torch.float32, [0, 3]), ("empty_i64", torch.int64, [2, 0]), ("scalar", torch.float64, []),
    ("scalar_i8", torch.int8, []), ("model.layers.0.weight", torch.float32, [3, 4]), (ODD_NAME, torch.float16, [2]),
]
# Integer dtypes: values (i % 13 - 6) * scale, or (i % 13) * scale when unsigned.
SCALES = {torch.int64: 1000000007000, torch.int32: 100000000, torch.int16: 2000, torch.int8: 10, torch.uint8: 19,
          torch.uint16: 5000, torch.uint32: 300000000, torch.uint64: 1000000007000000}
UNSIGNED = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)
META = {"format": "pt", "source": "libtorch-fsdp", "note": 'caf\u00e9 "quoted"'}


def pattern(dtype, shape):
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n, dtype=torch.int64)
    if dtype == torch.bool:
        v = i % 3 == 1
    elif dtype in SCALES:
        v = ((i % 13) if dtype in UNSIGNED else (i % 13 - 6)) * SCALES[dtype]
    elif dtype == torch.float8_e8m0fnu:  # powers of two only
        v = torch.pow(2.0, (i % 7 - 3).to(torch.float64))
    elif dtype == torch.complex64:
        v = torch.complex(((i % 13 - 6) * 0.5).float(), ((i % 5) * 0.25).float())
    else:
        v = (i % 13 - 6).to(torch.float64) * 0.5
    return v.to(dtype).reshape(shape)


def tensors():
    return {name: pattern(dtype, shape) for name, dtype, shape in SPECS}


def meta_tensors():
    return {"w": pattern(torch.bfloat16, [3, 2]), "b": pattern(torch.int32, [4])}


def raw(t):
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def split(data):
    n = struct.unpack("<Q", data[:8])[0]
    return data[8:8 + n], data[8 + n:]


def check_loads(path, expected, metadata):
    got = load_file(path)
    if set(got) != set(expected):
        fail(f"{path}: keys {sorted(got)} != {sorted(expected)}")
    for k, want in expected.items():
        t = got[k]
        if t.dtype != want.dtype or list(t.shape) != list(want.shape) or raw(t) != raw(want):
            fail(f"{path}: {k!r} is {t.dtype} {list(t.shape)} {raw(t)!r}, expected {want.dtype} "
                 f"{list(want.shape)} {raw(want)!r}")
    with safetensors.safe_open(path, framework="pt") as f:
        if f.metadata() != metadata:
            fail(f"{path}: metadata {f.metadata()} != {metadata}")


def check(directory):
    ours = os.path.join(directory, "cpp.safetensors")
    check_loads(ours, tensors(), {"format": "pt"})
    with tempfile.TemporaryDirectory() as tmp:
        theirs = os.path.join(tmp, "python.safetensors")
        save_file(tensors(), theirs, metadata={"format": "pt"})
        a, b = open(ours, "rb").read(), open(theirs, "rb").read()
        if a != b:
            at = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
            fail(f"{ours} ({len(a)} bytes) differs from save_file's ({len(b)} bytes) at byte {at}:\n"
                 f"ours:   {split(a)[0]!r}\npython: {split(b)[0]!r}")
        ours_meta = os.path.join(directory, "cpp_meta.safetensors")
        check_loads(ours_meta, meta_tensors(), META)
        theirs_meta = os.path.join(tmp, "python_meta.safetensors")
        save_file(meta_tensors(), theirs_meta, metadata=META)
        (ha, da), (hb, db) = split(open(ours_meta, "rb").read()), split(open(theirs_meta, "rb").read())
        if len(ha) != len(hb) or json.loads(ha) != json.loads(hb) or da != db:
            fail(f"{ours_meta}: header {ha!r} and data differ from save_file's {hb!r}")
    print("IDENTICAL")


def write(directory):
    save_file(tensors(), os.path.join(directory, "python.safetensors"), metadata={"format": "pt"})
    save_file(meta_tensors(), os.path.join(directory, "python_meta.safetensors"), metadata=META)
    print("WROTE")


if __name__ == "__main__":
    {"write": write, "check": check}[sys.argv[1]](sys.argv[2])
