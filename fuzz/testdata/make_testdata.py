"""Writes the Python-side checkpoints that //fuzz:corrupt_checkpoint_test reads and
tools/fuzz.sh seeds //fuzz:safetensors_fuzz with (run from this directory with any
torch >= 2.6 and safetensors >= 0.8; the outputs are checked in; `make_testdata.py
safetensors` writes only the .safetensors files):

  python_dict.pt        torch.save of a plain dict: a view with an offset and a stride, a
                        transposed view, an int64 scalar, bf16, bool, float64, an empty tensor
  python_state_dict.pt  torch.save(nn.Sequential(...).state_dict()): an OrderedDict with
                        _metadata (set by BUILD), weights set to arange values
  python_no_crc.pt      python_dict.pt's content saved with compute_crc32=False (CRC fields 0)
  python.safetensors    safetensors.torch.save_file of f32, bf16, int64 0-d, bool, empty and
                        uint8 tensors with metadata {"format": "pt"}
  python_odd.safetensors  a name that needs JSON escapes, an empty fp16 tensor, float8, and
                        two metadata keys (in the order of Python's hash map: any)
"""
import sys

import torch
from torch.utils.serialization import config


def plain_dict():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "view": base[1:, 2:5],
        "transposed": base.t(),
        "long_scalar": torch.tensor(7, dtype=torch.int64),
        "bf16": torch.arange(5, dtype=torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "double": torch.linspace(0, 1, 4, dtype=torch.float64),
        "empty": torch.empty(0, 3),
    }


def write_safetensors():
    from safetensors.torch import save_file

    save_file({
        "weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "bf16": torch.arange(4, dtype=torch.bfloat16) - 1.5,
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 2),
        "bytes": torch.arange(5, dtype=torch.uint8),
    }, "python.safetensors", metadata={"format": "pt"})
    save_file({
        'caf\u00e9 "q"\\\n': torch.arange(3, dtype=torch.int16),
        "e": torch.zeros(2, 0, dtype=torch.float16),
        "f8": torch.arange(4, dtype=torch.float32).to(torch.float8_e4m3fn),
    }, "python_odd.safetensors", metadata={"a": "1", "b": "\u00e9\n"})


def main():
    write_safetensors()
    if sys.argv[1:] == ["safetensors"]:
        return
    torch.save(plain_dict(), "python_dict.pt")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + 10 * i)
    torch.save(model.state_dict(), "python_state_dict.pt")
    config.save.compute_crc32 = False
    torch.save(plain_dict(), "python_no_crc.pt")


if __name__ == "__main__":
    main()
