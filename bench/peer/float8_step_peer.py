"""torchao 0.18's twin of bench/float8's Step benchmark: one training step (forward, backward,
SGD step, zero_grad) of N Linear(16, 16) layers, converted by torchao's
convert_to_float8_training (tensorwise recipe, eager) or plain (raw), batch 16, one intra-op
thread.

    python float8_step_peer.py BLOCKS[,BLOCKS...] REPETITIONS

Prints one line per block count and side, "PEER <float8|raw> <blocks> <median step seconds>".
"""
import sys

import torch
from torchao.float8 import convert_to_float8_training

from step_timing import LinearStack, median_step_seconds

DIM, BATCH = 16, 16


def step_seconds(blocks, float8, repetitions):
    torch.manual_seed(0)
    net = LinearStack(blocks, DIM)
    if float8:
        convert_to_float8_training(net)
    return median_step_seconds(net, torch.randn(BATCH, DIM), repetitions)


def main():
    block_counts = [int(b) for b in sys.argv[1].split(",")]
    repetitions = int(sys.argv[2])
    torch.set_num_threads(1)
    for blocks in block_counts:
        for float8 in (True, False):
            print(f"PEER {'float8' if float8 else 'raw'} {blocks} {step_seconds(blocks, float8, repetitions)}",
                  flush=True)


if __name__ == "__main__":
    main()
