"""PyTorch's own FSDP2 on the same model, weights, data and steps as a C++ run.

Usage: python fsdp2_peer.py --world W --input in.pt --output out.pt
  in.pt  (written by the C++ side): "param/<fqn>" initial full parameters, "x/<step>" and
         "y/<step>" the global batches, "steps" and "lr" as 1-element tensors.
  out.pt (read by the C++ side): "param/<fqn>", "exp_avg/<fqn>", "exp_avg_sq/<fqn>" full
         tensors after training, "step/<fqn>" the AdamW step count.
The model (peer_common.Net) mirrors fsdp/fsdp2/test_models.h: fully_shard on each block,
then on the root; gloo on CPU; each rank trains on its rows of the global batch.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import peer_common


def run(rank, world, init_file, inp, out):
    peer_common.init_gloo(rank, world, init_file)
    data = peer_common.load_input(inp)
    model = peer_common.build_net(data)
    for b in model.blocks():
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=float(data["lr"].item()))
    peer_common.train(model, opt, data, rank, world)
    params, states = {}, {}
    for name, p in model.named_parameters():  # full_tensor() is collective: every rank
        params[name] = p.full_tensor()
        states[name] = {k: (v.full_tensor() if k != "step" else v) for k, v in opt.state[p].items()}
    if rank == 0:
        peer_common.save_result(out, params, states)
    peer_common.finish_gloo()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    peer_common.spawn(run, args.world, args.input, args.output)


if __name__ == "__main__":
    main()
