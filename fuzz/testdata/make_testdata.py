"""Writes the Python-side checkpoints that //fuzz:corrupt_checkpoint_test reads (run from
this directory with any torch >= 2.6; the outputs are checked in):

  python_dict.pt        torch.save of a plain dict: a view with an offset and a stride, a
                        transposed view, an int64 scalar, bf16, bool, float64, an empty tensor
  python_state_dict.pt  torch.save(nn.Sequential(...).state_dict()): an OrderedDict with
                        _metadata (set by BUILD), weights set to arange values
  python_no_crc.pt      python_dict.pt's content saved with compute_crc32=False (CRC fields 0)
"""
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


def main():
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
