"""PyTorch's own FSDP1 (FullyShardedDataParallel) on the same model, weights, data and steps
as a C++ run.

Usage: python fsdp1_peer.py --world W --input in.pt --output out.pt [--use-orig-params]
  in.pt / out.pt: as fsdp2_peer.py (full parameters and AdamW state by original FQN).
FULL_SHARD, each block wrapped, then the root (as the C++ side: wrap_fsdp bottom-up); gloo on
CPU; the optimizer gets the FSDP module's parameters (flat parameters, or the originals with
--use-orig-params). The FQN-keyed result is gathered here from each handle's flat shard
(FSDP.optim_state_dict would do it too, but its object collectives need NumPy, which the
peer venv need not have).
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp._common_utils import clean_tensor_name

import peer_common


def unflatten_full(handle, shard, world):
    """This rank's shard of a flat tensor -> the original parameters' full tensors (collective)."""
    full = shard.new_empty(shard.numel() * world)
    dist.all_gather_into_tensor(full, shard.contiguous())
    return handle._get_unflat_views_aligned(full[: sum(handle.flat_param._numels_with_padding)])


def flat_shard_state(handle, opt, name):
    """The optimizer state `name` of the handle's flat shard: the flat parameter's own, or with
    use_orig_params assembled from the original parameters' (each holds its part of the shard)."""
    flat = handle.flat_param
    if not handle._use_orig_params:
        return opt.state[flat][name], opt.state[flat]["step"]
    out, step = torch.zeros_like(flat), None
    for info, p in zip(flat._shard_param_infos, flat._params):
        if info.in_shard and p in opt.state:
            out[info.offset_in_shard: info.offset_in_shard + info.numel_in_shard] = opt.state[p][name]
            step = opt.state[p]["step"]
    return out, step


def full_params_and_state(model, opt, world):
    """{fqn: full parameter}, {fqn: {"exp_avg", "exp_avg_sq", "step"}} (collective)."""
    params, states = {}, {}
    for module_name, module in model.named_modules():
        if not isinstance(module, FSDP) or module._handle is None:
            continue
        handle, prefix = module._handle, clean_tensor_name(module_name)
        fqns = [f"{prefix}.{f}" if prefix else f for f in handle.flat_param._fqns]
        for fqn, p in zip(fqns, unflatten_full(handle, handle.flat_param.detach(), world)):
            params[fqn] = p
            states[fqn] = {}
        for name in ("exp_avg", "exp_avg_sq"):
            shard, step = flat_shard_state(handle, opt, name)
            for fqn, s in zip(fqns, unflatten_full(handle, shard, world)):
                states[fqn][name] = s
                states[fqn]["step"] = step
    return params, states


def run(rank, world, init_file, inp, out, use_orig_params):
    peer_common.init_gloo(rank, world, init_file)
    data = peer_common.load_input(inp)
    model = peer_common.build_net(data)
    kwargs = dict(sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=use_orig_params,
                  device_id=torch.device("cpu"))
    for i in range(model.num_blocks):
        setattr(model, f"block{i}", FSDP(getattr(model, f"block{i}"), **kwargs))
    model = FSDP(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=float(data["lr"].item()))
    peer_common.train(model, opt, data, rank, world)
    params, states = full_params_and_state(model, opt, world)
    if rank == 0:
        peer_common.save_result(out, params, states)
    peer_common.finish_gloo()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--use-orig-params", action="store_true")
    args = parser.parse_args()
    peer_common.spawn(run, args.world, args.input, args.output, args.use_orig_params)


if __name__ == "__main__":
    main()
