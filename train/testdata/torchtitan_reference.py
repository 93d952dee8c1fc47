"""torchtitan 0.3.0's own training components on CPU Gloo: the reference of
train/torchtitan_parity_test.cc.

usage: torchtitan_reference.py SPEC.json OUT_DIR
       torchtitan_reference.py --load-ours SPEC.json CHECKPOINT OUT.pt

Runs `world` processes, each building torchtitan's Llama3Model (the debugmodel flavor's
builders, torchtitan/models/llama3/__init__.py, with the dimensions of SPEC), its
parallelize_llama (TP, activation checkpointing, FSDP: torchtitan/models/llama3/parallelize.py),
its learning-rate schedule, its loss (components/loss.py, summed cross-entropy divided by the
global valid-token count) and torchtitan's Trainer.train_step re-run over those components
(torchtitan/trainer.py), for SPEC's steps, on windows packed by torchtitan's own
HuggingFaceTextDataset (hf_datasets/text_datasets.py) over the prepared dataset's documents.
With SPEC's "pp" > 1 ("pp_schedule", default "1F1B"; "pp_microbatch_size", default 1) the model
goes through torchtitan's pipeline_llm instead (distributed/pipeline_parallel.py: its stage split,
parallelize_llama on each part, PyTorch's PipelineStage on the CPU and the schedule with the loss),
each part takes its keys of the initial weights, and each micro-batch runs as
Trainer.pp_forward_backward_step runs it (the positions go to every stage as keyword arguments);
the loss, known on the last stage's rank, is summed over the pp mesh, and clip_grad_norm_ reduces
over it.
Writes
  OUT_DIR/hf_init/model.safetensors   the initial weights (torchtitan's init_weights, seeded),
                                      in Hugging Face's names (torchtitan's Llama3StateDictAdapter)
  OUT_DIR/reference.pt                losses, max_losses, grad_norms, lrs: float64 [steps];
                                      with SPEC's "measure": step_seconds [steps] (rank 0's wall
                                      time of each step) and peak_bytes (the largest rank's
                                      LibTorch CPU allocation peak over steps 2.., counted as
                                      metrics/allocation_window.h counts ours: bench/peer/train_bench.py)
  OUT_DIR/final/rank<r>.safetensors   rank r's model parts' parameters after the last step, full
                                      (each DTensor gathered), in Hugging Face's names (q/k
                                      permuted by Llama3StateDictAdapter.to_hf, as hf_init)
  OUT_DIR/comm_counts/rank<r>.json    per step, rank r's FSDP all-gathers and reduce-scatters and
                                      the pipeline's sends and receives (CommCounter)
  OUT_DIR/checkpoint/step-N           with SPEC's "checkpoint_step" N: torchtitan's CheckpointManager
                                      (components/checkpointer/dcp.py) saving the model, its
                                      OptimizersContainer, LR schedulers, train state and a
                                      ParallelAwareDataloader after step N, as Trainer.train does
  OUT_DIR/state_step_N/{model,exp_avg,exp_avg_sq}.safetensors   the same state, full, in Hugging
                                      Face's names and rows as torchtitan's own code maps it (the
                                      fused qkv split by FusedQKVLinear's state-dict hook, then
                                      Llama3StateDictAdapter.to_hf, which permutes q/k)

--load-ours: a checkpoint our trainer saved (CHECKPOINT, a step-N folder) loaded with dcp.load
into torchtitan's Llama3Model through its Llama3StateDictAdapter (our keys are "model." + Hugging
Face's names: to_hf gives the state dict to load into, from_hf permutes q/k back), on one
process; OUT.pt holds "loss": the loaded model's loss on the global batch of step N + 1.

What differs from torchtitan's Trainer, and why (torchtitan assumes CUDA):
- attention is torchtitan's ScaledDotProductAttention (causal SDPA) instead of FlexAttention,
  which has no CPU backward; q/k/v are separate linears (fuse_qkv=False), which is a config
  field of the flavor builder and the layout torchtitan's state-dict adapter maps;
- torchtitan turns FSDP's gradient division off and FSDP then reduces with PREMUL_SUM, which is
  not a Gloo op: set_force_sum_reduction_for_comms(True) on every FSDP module (the same sums);
- the device is "cpu" where torchtitan/tools/utils.py decides "cuda" at import;
- the optimizer is torchtitan's OptimizersContainer of default_adamw with implementation
  "for-loop" (fused AdamW is CUDA's);
- the data: each step's windows are the packed stream's windows spread over the
  data-parallel ranks as train/dataloader.h documents (torchtitan splits documents by rank).
"""

import contextlib
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchtitan.tools.utils as tt_utils

tt_utils.device_type = "cpu"  # torchtitan decides "cuda" at import when no accelerator answers
tt_utils.device_module = torch.cpu

from safetensors.torch import save_file  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
)
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, default_adamw  # noqa: E402
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # noqa: E402
from torchtitan.config.configs import ParallelismConfig, TrainingConfig, CompileConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: E402
from torchtitan.distributed.pipeline_parallel import pipeline_llm  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim  # noqa: E402
from torchtitan.models.common.attention import FusedQKVLinear, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import (  # noqa: E402
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_llama3_layers,
    _output_linear_init,
    parallelize_llama,
)
from torchtitan.models.llama3.model import Llama3Model  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402


def model_config(spec):
    dim, n_heads, vocab = spec["dim"], spec["n_heads"], spec["vocab_size"]
    layers = _build_llama3_layers(
        fuse_qkv=spec.get("fuse_qkv", False),
        n_layers=spec["n_layers"],
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=spec["n_kv_heads"],
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
        rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
    )


class _Config:
    """What Llama3Model.Config.update_from_config reads of torchtitan's Trainer.Config."""

    def __init__(self, parallelism):
        self.parallelism = parallelism


def parallelism_config(spec):
    return ParallelismConfig(
        data_parallel_replicate_degree=spec["dp_replicate"],
        data_parallel_shard_degree=-1,
        tensor_parallel_degree=spec["tp"],
        enable_sequence_parallel=spec["sp"],
        # The DTensor path: its loss-parallel cross-entropy reads the vocab-sharded logits
        # outside the Trainer's spmd_types context.
        spmd_backend="partial_dtensor",
        pipeline_parallel_degree=spec.get("pp", 1),
        pipeline_parallel_schedule=spec.get("pp_schedule", "1F1B"),
        pipeline_parallel_microbatch_size=spec.get("pp_microbatch_size", 1),
    )


def float8_convert(config, f8):
    """torchtitan's Float8LinearConverter.convert (components/quantization/float8.py) with
    torchao 0.18's recipe SPEC["float8"]["recipe"] (emulate as given): every Linear.Config that
    module_filter_fn keeps becomes torchtitan's Float8Linear.Config. The converter's own
    constructor is bypassed: it refuses CPUs unless emulating, and then replaces the recipe by
    tensorwise."""
    from torchao.float8 import Float8LinearConfig
    from torchtitan.components.quantization.float8 import Float8Linear
    from torchtitan.components.quantization.utils import module_filter_fn

    recipe = Float8LinearConfig.from_recipe_name(f8["recipe"])
    fields = {f: getattr(recipe, f) for f in recipe.__dataclass_fields__}
    fields["emulate"] = f8.get("emulate", False)
    torchao_config = Float8LinearConfig(**fields)
    for fqn, linear, parent, attr in config.traverse(Linear.Config):
        if not module_filter_fn(linear, fqn, f8.get("filter_fqns", [])):
            continue
        new = Float8Linear.Config(in_features=linear.in_features, out_features=linear.out_features,
                                  bias=linear.bias, param_init=linear.param_init, _torchao_config=torchao_config)
        if parent is None:
            config = new
        elif isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return config


def build_model(spec, parallelism):
    config = model_config(spec)
    if spec.get("float8"):
        config = float8_convert(config, spec["float8"])
    config.update_from_config(config=_Config(parallelism))
    return config, config.build()


def initial_weights(spec, out_dir):
    """torchtitan's init_weights on one unsharded model, seeded: its state dict, and the same
    weights saved in Hugging Face's names for the C++ side."""
    torch.manual_seed(spec["seed"])
    config, model = build_model(spec, parallelism_config(dict(spec, tp=1, dp_replicate=1)))
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf = Llama3StateDictAdapter(config, None).to_hf(state)
    os.makedirs(os.path.join(out_dir, "hf_init"), exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(out_dir, "hf_init", "model.safetensors"),
              metadata={"format": "pt"})
    return state


class _Documents:
    """The prepared dataset's documents as torchtitan's HuggingFaceTextDataset sees samples."""

    def __init__(self, prefix):
        index = np.fromfile(prefix + ".index", dtype=np.uint8)
        header = index[:64]
        token_bytes = int(header[12:16].view(np.uint32)[0])
        n_docs = int(header[40:48].view(np.uint64)[0])
        self.offsets = index[64:64 + 8 * (n_docs + 1)].view(np.uint64).astype(np.int64)
        self.tokens = np.fromfile(prefix + ".tokens", dtype=np.uint16 if token_bytes == 2 else np.uint32)

    def __len__(self):
        return len(self.offsets) - 1

    def document(self, i):
        return self.tokens[self.offsets[i]:self.offsets[i + 1]].astype(np.int64).tolist()


def packed_windows(spec, count):
    """The first `count` windows of torchtitan's own packing (HuggingFaceTextDataset.__iter__,
    dp_world_size 1) over the dataset's documents in file order."""
    from torchtitan.hf_datasets import text_datasets as td

    docs = _Documents(spec["dataset"])

    class Tokenizer:
        def encode(self, text, add_bos=True, add_eos=True):
            return docs.document(text)  # the stored ids already hold BOS and EOS

    dataset = td.HuggingFaceTextDataset.__new__(td.HuggingFaceTextDataset)
    dataset.dataset_name = "prepared"
    dataset._original_data = dataset._data = list(range(len(docs)))
    dataset._tokenizer = Tokenizer()
    dataset.seq_len = spec["seq_len"]
    dataset.infinite = False
    dataset._text_processor = lambda sample: sample
    dataset._sample_idx = dataset._epoch = 0
    dataset._inputs_buffer, dataset._labels_buffer, dataset._positions_buffer = [], [], []
    dataset._get_data_iter = lambda: iter(dataset._data[dataset._sample_idx:])
    out = []
    for inputs, labels in dataset:
        out.append((inputs["input"], inputs["positions"], labels))
        if len(out) == count:
            return out
    raise SystemExit(f"{spec['dataset']}: fewer than {count} windows of {spec['seq_len']} tokens")


def load_initial_weights(model, spec, init_state):
    """init_state (stock q/k/v names) into the parallelized model. A fused model's
    set_model_state_dict(full_state_dict=True) fails in FusedQKVLinear's merge hook (it merges
    plain tensors into a DTensor parameter), so there each full parameter is merged on an
    unsharded twin and distributed by hand (1-D meshes: Shard(0) / Replicate)."""
    if not spec.get("fuse_qkv"):
        set_model_state_dict(model, init_state, options=StateDictOptions(full_state_dict=True))
        return
    _, plain = build_model(spec, parallelism_config(dict(spec, tp=1, dp_replicate=1)))
    plain.load_state_dict(init_state)
    full = dict(plain.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = full[name]
            if isinstance(param, DTensor):
                source = distribute_tensor(source, param.device_mesh, param.placements)
            param.copy_(source)


def save_full_state(model, optimizer, config, out_dir, rank):
    """OUT_DIR/state_step_N (module docstring). Collective."""
    full = StateDictOptions(full_state_dict=True)
    # model.state_dict(), as torchtitan's ModelWrapper takes it (get_model_state_dict cannot
    # follow the hook's stock wq/wk/wv names back to a module), gathered.
    tensors = {"model": {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}}
    state = get_optimizer_state_dict(model, optimizer.optimizers[0], options=full)["state"]
    attention = config.layers[0].attention
    fused = SimpleNamespace(head_dim=config.dim // attention.n_heads,
                            heads_per_kv=attention.n_heads // attention.n_kv_heads,
                            r_dim=attention.n_heads // attention.n_kv_heads + 2)
    for name in ("exp_avg", "exp_avg_sq"):
        tensors[name] = {fqn: values[name] for fqn, values in state.items()}
        for fqn in [f for f in tensors[name] if f.endswith("qkv_linear.wqkv.weight")]:
            FusedQKVLinear._split_qkv_on_save(fused, tensors[name], fqn[:-len("wqkv.weight")], None)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        adapter = Llama3StateDictAdapter(config, None)
        for name, values in tensors.items():
            hf = adapter.to_hf({k: v.detach().clone() for k, v in values.items()})
            save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(out_dir, name + ".safetensors"))


class _TrainState(Stateful):
    """Trainer.state_dict / load_state_dict (torchtitan/trainer.py)."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict):
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


class _NoData(torch.utils.data.IterableDataset):
    """The dataset of the checkpointed ParallelAwareDataloader: the steps read `windows`."""

    def __iter__(self):
        return iter(())


def pipelined_forward_backward(schedule, has_first_stage, has_last_stage, spec, inputs, positions, labels,
                               global_valid):
    """Trainer.pp_forward_backward_step on this rank's rows of one micro-batch: its data loader
    hands out pp_microbatch_size rows at a time (consecutive rows of the local batch), the
    tokens go to the first stage, the positions (post_dataloading_process's extra kwargs) to
    every stage, the labels and the global valid-token count to the loss on the last stage.
    The loss is the sum of the last stage's microbatch losses; 0 elsewhere (torchtitan
    returns -1 there and logs from the last stage)."""
    size = spec.get("pp_microbatch_size", 1)
    rows = [slice(i, i + size) for i in range(0, inputs.shape[0], size)]
    losses = [] if has_last_stage else None
    schedule.step(arg_mbs=[(inputs[r],) for r in rows] if has_first_stage else None,
                  kwarg_mbs=[{"positions": positions[r]} for r in rows],
                  target_mbs=[labels[r] for r in rows] if has_last_stage else None,
                  losses=losses, loss_kwargs={"global_valid_tokens": global_valid}, return_outputs=False)
    if has_last_stage:
        return torch.sum(torch.stack(losses))
    return torch.zeros((), dtype=torch.float32)


class CommCounter:
    """Counts the torch.distributed calls FSDP2 (_fsdp_collectives.py: all_gather_single,
    reduce_scatter_single) and the pipelining stages (P2POps of isend / irecv, alone or in
    batch_isend_irecv) make, per step. torch.distributed and its distributed_c10d get the same
    wrapper, since P2POp checks its op against the latter's."""

    KINDS = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
             "isend": "send", "irecv": "recv"}

    def __init__(self):
        import torch.distributed.distributed_c10d as c10d
        self.steps, self.current = [], dict.fromkeys(self.KINDS.values(), 0)
        for name, kind in self.KINDS.items():
            wrapped = self._counting(getattr(dist, name), kind)
            for module in (dist, c10d):
                if hasattr(module, name):
                    setattr(module, name, wrapped)

    def _counting(self, fn, kind):
        def counted(*args, **kwargs):
            self.current[kind] += 1
            return fn(*args, **kwargs)
        return counted

    def begin_step(self):
        self.current = dict.fromkeys(self.KINDS.values(), 0)

    def end_step(self):
        self.steps.append(self.current)


def worker(rank, spec, out_dir, store, init_state, windows):
    torch.set_num_threads(1)
    world = spec["world"]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    counter = CommCounter()
    parallelism = parallelism_config(spec)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)  # as Trainer.__init__
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    training = TrainingConfig(
        local_batch_size=spec["local_batch_size"], global_batch_size=spec["global_batch_size"],
        seq_len=spec["seq_len"], max_norm=spec["max_norm"], steps=spec["steps"],
        mixed_precision_param="float32", mixed_precision_reduce="float32")
    config, model = build_model(spec, parallelism)
    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[spec["ac"]]
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    if dims.pp_enabled:
        # Trainer.__init__ under pp: pipeline_llm splits the model into this rank's stages'
        # parts (torchtitan's _generate_llm_fqn_per_model_part), runs parallelize_llama on
        # each and builds the schedule with the loss (scale_grads off).
        pipeline = pipeline_llm(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                compile_config=CompileConfig(), ac_config=ac, dump_folder=out_dir,
                                device=torch.device("cpu"), model_config=config, parallelize_fn=parallelize_llama,
                                loss_fn=loss_fn)
        del model
        pp_schedule, model_parts, has_first_stage, has_last_stage = pipeline
    else:
        model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                  compile_config=CompileConfig(), ac_config=ac, dump_folder=out_dir)
        pp_schedule, model_parts = None, [model]
    for part in model_parts:
        for module in part.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
        with torch.no_grad():
            part.init_weights(buffer_device=torch.device("cpu"))  # the rope cache; weights replaced next
        if pp_schedule is None:
            load_initial_weights(part, spec, init_state)
        else:  # a stage's part keeps the whole model's names for what it holds (_split_module)
            held = part.state_dict().keys()
            load_initial_weights(part, spec, {k: v for k, v in init_state.items() if k in held})
        part.train()

    optimizer_config = default_adamw(lr=spec["lr"])
    optimizer_config.implementation = "for-loop"
    optimizer = OptimizersContainer(optimizer_config, model_parts=model_parts)
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=spec["warmup_steps"], decay_ratio=spec["decay_ratio"], decay_type=spec["decay_type"],
        min_lr_factor=spec["min_lr_factor"]).build(optimizers=optimizer, training_steps=spec["steps"])

    batch_mesh = dims.get_optional_mesh("batch")
    dp, local = dims.dp_replicate * dims.dp_shard, spec["local_batch_size"]
    dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
    accumulation = spec["global_batch_size"] // (local * dp)
    checkpointer = train_state = None
    if spec.get("checkpoint_step"):
        assert pp_schedule is None, "checkpoint_step with pp is not implemented here"
        train_state = _TrainState()
        loader = ParallelAwareDataloader(_NoData(), dp_rank=dp_rank, dp_world_size=dp, batch_size=local)
        checkpointer = CheckpointManager(
            CheckpointManager.Config(enable=True, interval=spec["checkpoint_step"], keep_latest_k=0,
                                     last_save_model_only=False),
            dataloader=loader, model_parts=[model], optimizers=optimizer, lr_schedulers=schedulers,
            states={"train_state": train_state}, sd_adapter=None, base_folder=out_dir)
    losses, max_losses, norms, lrs, seconds = [], [], [], [], []
    window = contextlib.nullcontext()
    if spec.get("measure"):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "peer"))
        from peer_common import AllocationWindow
        window = AllocationWindow()
    memory = window.__enter__()
    for step in range(spec["steps"]):
        if step == 1 and memory is not None:
            memory.mark()  # steady steps: the optimizer state exists from here on
        start = time.perf_counter()
        counter.begin_step()
        # Trainer.train_step, over this rank's rows of each micro-batch (train/dataloader.h).
        optimizer.zero_grad(set_to_none=True)
        lrs.append(schedulers.schedulers[0].get_last_lr()[0])
        micro = []
        local_valid = torch.tensor(0, dtype=torch.int64)
        for m in range(accumulation):
            first = step * spec["global_batch_size"] + m * local * dp + dp_rank * local
            rows = windows[first:first + local]
            inputs = torch.stack([w[0] for w in rows])
            positions = torch.stack([w[1] for w in rows])
            labels = torch.stack([w[2] for w in rows])
            local_valid += (labels != IGNORE_INDEX).sum()
            micro.append((inputs, positions, labels))
        global_valid = dist_utils.dist_sum_tensor(local_valid, batch_mesh, None) if batch_mesh is not None \
            else local_valid
        accumulated = None
        for inputs, positions, labels in micro:
            if pp_schedule is not None:
                loss = pipelined_forward_backward(pp_schedule, has_first_stage, has_last_stage, spec,
                                                  inputs, positions, labels, global_valid)
                accumulated = loss.detach().clone() if accumulated is None else accumulated.add_(loss.detach())
                continue
            pred = model(inputs, positions=positions)
            loss, _ = loss_fn(pred, labels, global_valid)
            del pred
            loss.backward()
            accumulated = loss.detach().clone() if accumulated is None else accumulated.add_(loss.detach())
        if pp_schedule is not None:
            # The step's loss is known on the last stage's rank: summed over the pp mesh (the
            # other ranks contribute 0) so that every rank, rank 0 included, holds it.
            dist.all_reduce(accumulated, group=dims.get_mesh("pp").get_group())
        grad_norm = dist_utils.clip_grad_norm_([p for part in model_parts for p in part.parameters()],
                                               spec["max_norm"], foreach=True,
                                               pp_mesh=dims.get_optional_mesh("pp"), ep_enabled=False)
        optimizer.step()
        schedulers.step()
        if checkpointer is not None:  # Trainer.train: the step's counters, then checkpointer.save
            train_state.step = step + 1
            train_state.ntokens_seen += accumulation * local * spec["seq_len"]
            checkpointer.save(step + 1, last_step=False)
            if step + 1 == spec["checkpoint_step"]:
                save_full_state(model, optimizer, config, os.path.join(out_dir, f"state_step_{step + 1}"), rank)
        if batch_mesh is not None:
            local_mean = accumulated * global_valid / local_valid
            losses.append(dist_utils.dist_sum(accumulated, batch_mesh))
            max_losses.append(dist_utils.dist_max(local_mean, batch_mesh))
        else:
            losses.append(float(accumulated))
            max_losses.append(float(accumulated))
        norms.append(float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm))
        seconds.append(time.perf_counter() - start)
        counter.end_step()
    window.__exit__(None, None, None)
    if checkpointer is not None:
        checkpointer.close()
    final = {}
    for part in model_parts:  # full_tensor: collective over the ranks of each part's mesh
        final.update({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in part.state_dict().items()})
    hf = Llama3StateDictAdapter(config, None).to_hf({k: v.detach().clone() for k, v in final.items()})
    os.makedirs(os.path.join(out_dir, "final"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "comm_counts"), exist_ok=True)
    with open(os.path.join(out_dir, "comm_counts", f"rank{rank}.json"), "w") as f:
        json.dump(counter.steps, f)
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(out_dir, "final", f"rank{rank}.safetensors"))
    out = {"losses": torch.tensor(losses, dtype=torch.float64),
           "max_losses": torch.tensor(max_losses, dtype=torch.float64),
           "grad_norms": torch.tensor(norms, dtype=torch.float64),
           "lrs": torch.tensor(lrs, dtype=torch.float64)}
    if memory is not None:
        peak = torch.tensor([memory.peak], dtype=torch.int64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out.update(step_seconds=torch.tensor(seconds, dtype=torch.float64), peak_bytes=peak)
    if rank == 0:
        torch.save(out, os.path.join(out_dir, "reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


def load_ours(spec, checkpoint, out_path):
    """--load-ours: see the module docstring."""
    config, model = build_model(spec, parallelism_config(dict(spec, tp=1, dp_replicate=1)))
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))  # the rope cache; weights loaded next
    adapter = Llama3StateDictAdapter(config, None)
    hf = {k: v.detach().clone() for k, v in adapter.to_hf(model.state_dict()).items()}
    dcp.load({"model": hf}, checkpoint_id=checkpoint)
    model.load_state_dict(adapter.from_hf(hf))
    step = int(os.path.basename(os.path.normpath(checkpoint)).split("-")[1])
    g = spec["global_batch_size"]
    rows = packed_windows(spec, (step + 1) * g)[step * g:]
    inputs, positions, labels = (torch.stack([w[i] for w in rows]) for i in range(3))
    with torch.no_grad():
        pred = model(inputs, positions=positions)
        valid = (labels != IGNORE_INDEX).sum()
        loss, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(pred, labels, valid)
    torch.save({"loss": torch.tensor([float(loss)], dtype=torch.float64)}, out_path)
    print("OK")


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--load-ours":
        with open(sys.argv[2]) as f:
            spec = json.load(f)
        return load_ours(spec, sys.argv[3], sys.argv[4])
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json OUT_DIR | --load-ours SPEC.json CHECKPOINT OUT.pt")
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out_dir = sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    init_state = initial_weights(spec, out_dir)
    windows = packed_windows(spec, spec["steps"] * spec["global_batch_size"])
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(spec, out_dir, os.path.join(tmp, "store"), init_state, windows),
                           nprocs=spec["world"], start_method="fork")
    print("OK")


if __name__ == "__main__":
    main()
