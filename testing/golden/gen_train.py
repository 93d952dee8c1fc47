"""Golden trainer corpus from real torchtitan: the learning-rate schedule.

Run with the peer venv's python (`./x golden` does; the peer venv has torchtitan 0.3.0). Writes

  train/testdata/golden_lr_schedule.txt     read by train/lr_scheduler_test.cc
  train/testdata/golden_config_defaults.toml  read by train/config_test.cc
  train/testdata/golden_peak_flops.txt      read by train/trainer_test.cc

Each case builds torchtitan's own LRSchedulersContainer (components/optimizer/lr_scheduler.py,
LRSchedulersContainer.Config(...).build) over a torch.optim.AdamW and records the learning
rate torch's LambdaLR sets after construction and after each step(), as torchtitan's trainer
steps it once per training step; then, from its state_dict() after k steps, a fresh
container's learning rates after load_state_dict() and each further step (a resume).
Regenerating reproduces the file byte for byte.
"""

import itertools
import json
import time

import golden_common as gc
import torch
import torchtitan
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

GOLDEN = "train/testdata/golden_lr_schedule.txt"
BASE_LR = 8e-4
# Steps past training.steps: the schedule beyond its end (and torchtitan's assertion there).
EXTRA_STEPS = 2

DOC = f"""
torchtitan {torchtitan.__version__}'s learning-rate schedule (testing/golden/gen_train.py); fields
tab-separated. A case: torchtitan's LRSchedulersContainer.Config(warmup_steps, total_steps,
decay_ratio, decay_type, min_lr_factor).build(training_steps=N) over AdamW(lr={BASE_LR!r}):
  case <name> <N> <warmup_steps> <total_steps> <decay_ratio> <decay_type> <min_lr_factor>
                                    (`-`: None)
  lrs <lr,...>                      the lr after construction, then after each step(): N of them
                                    and EXTRA more (what a schedule does past its end)
  error <k>                         step() number k raised (torchtitan asserts there), the
                                    lrs before it recorded above
  resume <k> <lr,...>               a new container after load_state_dict(state after k steps):
                                    its get_last_lr(), then the lr after each further step()
                                    up to N + EXTRA
Numbers are Python's shortest round-trip repr. EXTRA = {EXTRA_STEPS}.
"""

TRAINING_STEPS = (1, 10, 37)
WARMUP_STEPS = (0, 1, 3, 50)
DECAY_RATIOS = (None, 0.0, 0.25, 1.0)
DECAY_TYPES = ("linear", "sqrt", "cosine")
MIN_LR_FACTORS = (0.0, 0.1)


def container(config, steps):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=BASE_LR)
    # build() iterates over its optimizers and takes their number: a list is an OptimizersContainer here.
    return opt, config.build(optimizers=[opt], training_steps=steps)


def lr_of(opt):
    return opt.param_groups[0]["lr"]


def run_case(golden, steps, warmup, total, ratio, decay_type, min_lr):
    config = LRSchedulersContainer.Config(
        warmup_steps=warmup, total_steps=total, decay_ratio=ratio, decay_type=decay_type, min_lr_factor=min_lr
    )
    name = "_".join(
        [
            f"n{steps}",
            f"w{warmup}",
            "t-" if total is None else f"t{total}",
            "dr-" if ratio is None else f"dr{gc.number(ratio)}",
            decay_type,
            f"min{gc.number(min_lr)}",
        ]
    )
    golden.add(
        "\t".join(
            [
                "case",
                name,
                str(steps),
                str(warmup),
                "-" if total is None else str(total),
                "-" if ratio is None else gc.number(ratio),
                decay_type,
                gc.number(min_lr),
            ]
        )
    )
    opt, sched = container(config, steps)
    lrs = [lr_of(opt)]
    failed_at = None
    for k in range(1, steps + EXTRA_STEPS + 1):
        try:
            sched.step()
        except AssertionError:
            failed_at = k
            break
        lrs.append(lr_of(opt))
    golden.add("lrs\t" + ",".join(gc.number(v) for v in lrs))
    if failed_at is not None:
        golden.add(f"error\t{failed_at}")
    else:
        k = steps // 2
        _, sched0 = container(config, steps)
        for _ in range(k):
            sched0.step()
        state = sched0.state_dict()
        opt1, sched1 = container(config, steps)
        sched1.load_state_dict(state)
        # load_state_dict recomputes the scheduler's last lr, not the optimizer's (the
        # optimizer's own state_dict restores that): the first value is get_last_lr().
        resumed = [sched1.schedulers[0].get_last_lr()[0]]
        for _ in range(k, steps + EXTRA_STEPS):
            sched1.step()
            resumed.append(lr_of(opt1))
        golden.add(f"resume\t{k}\t" + ",".join(gc.number(v) for v in resumed))
    golden.records += 1


CONFIG_GOLDEN = "train/testdata/golden_config_defaults.toml"
CONFIG_DOC = f"""
torchtitan {torchtitan.__version__}'s defaults for the keys of train/config.h that torchtitan has
(testing/golden/gen_train.py): each value read from a default-constructed torchtitan config class.
[optimizer] is default_adamw()'s catch-all AdamW group; [float8] is Float8LinearConverter.Config; [activation_checkpoint] mode is the class
Trainer.Config defaults to; [dataloader] is HuggingFaceTextDataLoader.Config. A None default is
left out (it is an unset optional here). Keys of ours that torchtitan does not have are absent.
"""


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def write_config_defaults():
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.components.validate import Validator
    from torchtitan.config.configs import CommConfig, DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.trainer import Trainer

    trainer = Trainer.Config()
    group = default_adamw().param_groups[0]
    assert group.pattern == ".*"
    modes = {SelectiveAC.Config: "selective", FullAC.Config: "full"}
    tables = {
        "": (trainer, ["dump_folder"]),
        "optimizer": (dict(name=group.optimizer_name, **group.optimizer_kwargs), ["name", "lr", "betas", "eps", "weight_decay"]),
        "lr_scheduler": (LRSchedulersContainer.Config(), ["warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor"]),
        "training": (TrainingConfig(), ["local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "dtype",
                                        "mixed_precision_param", "mixed_precision_reduce"]),
        "parallelism": (ParallelismConfig(), ["data_parallel_replicate_degree", "data_parallel_shard_degree",
                                              "fsdp_reshard_after_forward", "tensor_parallel_degree", "enable_sequence_parallel",
                                              "pipeline_parallel_degree", "pipeline_parallel_schedule",
                                              "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                                              "pipeline_parallel_layers_per_stage",
                                              "pipeline_parallel_first_stage_less_layers",
                                              "pipeline_parallel_last_stage_less_layers",
                                              "context_parallel_degree", "context_parallel_load_balancer"]),
        "activation_checkpoint": (dict(mode=modes[type(trainer.activation_checkpoint)],
                                       preserve_rng_state=trainer.activation_checkpoint.preserve_rng_state,
                                       force_recompute_mm_shapes_by_fqns=SelectiveAC.Config().force_recompute_mm_shapes_by_fqns),
                                  ["mode", "preserve_rng_state", "force_recompute_mm_shapes_by_fqns"]),
        "float8": (Float8LinearConverter.Config(), ["recipe_name", "filter_fqns", "emulate"]),
        "dataloader": (HuggingFaceTextDataLoader.Config(), ["dataset_path", "infinite"]),
        "validator": (Validator.Config(), ["enable", "freq", "steps"]),
        "metrics": (MetricsProcessor.Config(), ["log_freq", "enable_tensorboard", "save_tb_folder", "save_for_all_ranks"]),
        "checkpoint": (CheckpointManager.Config(), ["enable", "folder", "interval", "initial_load_path",
                                                    "initial_load_model_only", "initial_load_in_hf", "last_save_model_only",
                                                    "last_save_in_hf", "export_dtype", "keep_latest_k", "load_step",
                                                    "exclude_from_loading", "enable_first_step_checkpoint", "async_mode"]),
        "comm": (CommConfig(), ["init_timeout_seconds", "train_timeout_seconds", "trace_buf_size"]),
        "debug": (DebugConfig(), ["seed", "deterministic"]),
    }
    golden = gc.GoldenFile(CONFIG_GOLDEN, CONFIG_DOC)
    for table, (obj, keys) in tables.items():
        if table:
            golden.add(f"\n[{table}]")
        for key in keys:
            value = obj[key] if isinstance(obj, dict) else getattr(obj, key)
            if value is not None:
                golden.add(f"{key} = {toml_value(value)}")
                golden.records += 1
    golden.write()


SAC_GOLDEN = "train/testdata/golden_sac_save_ops.txt"
SAC_DOC = f"""
The operators whose outputs torchtitan {torchtitan.__version__}'s SelectiveAC keeps
(torchtitan/distributed/activation_checkpoint.py: _get_default_save_ops), one per line as
"namespace::name" or "namespace::name.overload" (testing/golden/gen_train.py). Higher-order operators
in that set (flex_attention, inductor_compiled_code) are not ATen operators and are left out.
"""


def write_sac_save_ops():
    from torchtitan.distributed.activation_checkpoint import _get_default_save_ops

    golden = gc.GoldenFile(SAC_GOLDEN, SAC_DOC)
    names = []
    for op in _get_default_save_ops():
        if not isinstance(op, torch._ops.OpOverload):
            continue
        overload = "" if op._overloadname == "default" else "." + op._overloadname
        names.append(op._schema.name + overload)
    for name in sorted(names):
        golden.add(name)
        golden.records += 1
    golden.write()


SPLIT_GOLDEN = "train/testdata/golden_pipeline_split.txt"
SPLIT_DOC = f"""
torchtitan {torchtitan.__version__}'s split of a Llama model into pipeline stages
(torchtitan/distributed/pipeline_parallel.py: _get_pipeline_metadata, then
_generate_llm_fqn_per_model_part), read by train/pipeline_llama_test.cc; fields tab-separated.
  case <pp> <schedule> <layers> <layers_per_stage or -> <first_less> <last_less>
  stages <n>                      the number of virtual stages
  stage <i> <module,...>          stage i's modules (torchtitan's names), in order
  error                           torchtitan raised (ValueError) for this case
"""


def write_pipeline_splits():
    import itertools
    import types

    from torchtitan.config.configs import ParallelismConfig
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _get_pipeline_metadata

    golden = gc.GoldenFile(SPLIT_GOLDEN, SPLIT_DOC)
    for pp, schedule, layers, per_stage, first, last in itertools.product(
            (2, 3, 4), ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"), (2, 3, 5, 8, 16), (None, 1, 2, 3, 5),
            (0, 1, 2), (0, 1, 2)):
        parallelism = ParallelismConfig(pipeline_parallel_degree=pp, pipeline_parallel_schedule=schedule,
                                        pipeline_parallel_layers_per_stage=per_stage,
                                        pipeline_parallel_first_stage_less_layers=first,
                                        pipeline_parallel_last_stage_less_layers=last)
        dims = types.SimpleNamespace(pp=pp)
        model = types.SimpleNamespace(layers=[None] * layers)
        golden.add("\t".join(["case", str(pp), schedule, str(layers), "-" if per_stage is None else str(per_stage),
                               str(first), str(last)]))
        golden.records += 1
        try:
            stages, num_layers, in_w, out_w = _get_pipeline_metadata(dims, parallelism, model)
            names = _generate_llm_fqn_per_model_part(stages, num_layers, in_w, out_w)
        except ValueError:
            golden.add("error")
            continue
        golden.add(f"stages\t{stages}")
        for i, modules in enumerate(names):
            golden.add(f"stage\t{i}\t" + ",".join(modules))
    golden.write()


PEAK_GOLDEN = "train/testdata/golden_peak_flops.txt"
PEAK_DOC = f"""
torchtitan {torchtitan.__version__}'s peak FLOP/s of a device by its name (torchtitan/tools/utils.py:
get_peak_flops, with `lspci` absent so that the name decides), read by train/trainer_test.cc;
fields tab-separated:
  peak_flops <device name as torch.cuda.get_device_name gives it> <FLOP/s, repr>
"""
# Names as torch.cuda.get_device_name reports them, one or more per branch of the table, and
# some it does not know (its A100 fallback).
DEVICE_NAMES = [
    "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA RTX A6000", "NVIDIA H100 80GB HBM3",
    "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H20", "NVIDIA GB200",
    "NVIDIA GB300", "NVIDIA B200", "NVIDIA B300 SXM6 AC", "AMD Instinct MI355X", "AMD Instinct MI300X",
    "AMD Instinct MI325X", "AMD Instinct MI250X", "NVIDIA L40S", "nvidia l40s", "Tesla V100-SXM2-16GB",
    "NVIDIA GeForce RTX 4090",
]


def write_peak_flops():
    import subprocess

    from torchtitan.tools import utils

    def no_lspci(*args, **kwargs):
        raise FileNotFoundError("lspci")

    golden = gc.GoldenFile(PEAK_GOLDEN, PEAK_DOC)
    run, subprocess.run = subprocess.run, no_lspci
    try:
        for name in DEVICE_NAMES:
            golden.add(f"peak_flops\t{name}\t{utils.get_peak_flops(name)!r}")
            golden.records += 1
    finally:
        subprocess.run = run
    golden.write()


def main():
    gc.quiet_torch()
    start = time.time()
    write_config_defaults()
    write_peak_flops()
    write_sac_save_ops()
    write_pipeline_splits()
    golden = gc.GoldenFile(GOLDEN, DOC)
    for steps, warmup, ratio, decay_type, min_lr in itertools.product(
        TRAINING_STEPS, WARMUP_STEPS, DECAY_RATIOS, DECAY_TYPES, MIN_LR_FACTORS
    ):
        for total in (None, 2 * steps):
            run_case(golden, steps, warmup, total, ratio, decay_type, min_lr)
    golden.write()
    print(f"gen_train.py: {time.time() - start:.1f} s with torch {torch.__version__}, torchtitan {torchtitan.__version__}")


if __name__ == "__main__":
    main()
