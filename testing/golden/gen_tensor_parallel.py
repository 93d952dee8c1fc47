"""Golden tensor-parallel corpus from real PyTorch: parallel styles and loss parallel.

Run with the peer venv's python (`./x golden` does): CPU only, all ranks simulated in this
process by LocalTensorMode over PyTorch's fake process group (golden_common.simulated_world),
so the styles, redistributes and collectives are PyTorch's own code. Writes

  tensor_parallel/testdata/golden_tensor_parallel.txt   read by tensor_parallel/parallel_style_test.cc

Each case builds a small float64 model (the same models in C++: tensor_parallel/parallel_style_test.cc),
sets its parameters by the rule below, applies a plan with parallelize_module, runs one
forward and one backward, and records what every rank sees. Regenerating reproduces the file
byte for byte.
"""

import time

import golden_common as gc
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

DOC = """
Tensor-parallel styles and loss parallel on every rank (testing/golden/gen_tensor_parallel.py),
float64; fields tab-separated. A style case:
  case <name> <world> <model> <input dtype: f|i>
  plan <key> <style>                  one per plan entry, in order ("" is written `-`)
  in <rank> <shape> <values>          the module's input on that rank (a local tensor)
  outgrad <rank> <shape> <values>     the gradient given to that rank's output in backward
  comms forward <kind>=<count>,...    collectives counted by CommDebugMode (`-`: none)
  comms backward <kind>=<count>,...
  out <rank> <shape> <values>         the output's local tensor
  ingrad <rank> <shape> <values>      the input's gradient (float inputs only)
  pgrad <fqn> <placement> <shape> <values>   a parameter's gradient: the full tensor, and the
                                      placement PyTorch leaves it in (P(sum): reduced later)
Styles: colwise:<input>:<output>:<use_local_output 0|1>, rowwise:<input>:<output>:<0|1>
(`-`: the style's default), sequence:<sequence_dim>:<0|1>,
input:<input_layouts>:<desired>:<0|1>, output:<output_layouts>:<desired>:<0|1>,
inout:<input_layouts>:<desired>:<use_local_input>:<output_layouts>:<desired>:<use_local_output>;
layout lists comma-separated, `-` for None. Models (nn.Linear(in, out), nn.Embedding(n, d)):
  linear_<in>_<out>, linear_nobias_<in>_<out>, embedding_<n>_<d>, layernorm_<d>,
  ffn: w1 Linear(4,6), w2 Linear(4,6), w3 Linear(6,4); forward w3(silu(w1(x)) * w2(x))
  sp_block: norm LayerNorm(4), ffn (as above); forward x + ffn(norm(x))
  stack: layers = ModuleList of two ffn; forward x = x + layer(x) for each
Parameter rule, before parallelize_module: the parameter named fqn with n elements is
((arange(n) * 7 + len(fqn)) % 13 - 6) / 8 in its shape.
A loss case (F.cross_entropy under loss_parallel(), logits DTensor Shard(1) of [N, C]):
  loss <world> <N> <C> <reduction> <ignore_index>
  target <values>
  in <rank> <shape> <values>          the logits' local tensor
  comms forward ... / comms backward ...
  value <loss shape> <values>         the loss (replicated)
  ingrad <rank> <shape> <values>      the logits' local gradient (backward of loss.sum())
"""

GOLDEN = "tensor_parallel/testdata/golden_tensor_parallel.txt"


def P(token):
    if token == "-":
        return None
    if token == "R":
        return Replicate()
    if token.startswith("S("):
        return Shard(int(token[2:-1]))
    raise ValueError(token)


def layouts(token):
    return tuple(P(t) for t in token.split(","))


def style_of(token):
    kind, *a = token.split(":")
    if kind in ("colwise", "rowwise"):
        cls = ColwiseParallel if kind == "colwise" else RowwiseParallel
        return cls(input_layouts=P(a[0]), output_layouts=P(a[1]), use_local_output=a[2] == "1")
    if kind == "sequence":
        return SequenceParallel(sequence_dim=int(a[0]), use_local_output=a[1] == "1")
    if kind == "input":
        return PrepareModuleInput(
            input_layouts=layouts(a[0]), desired_input_layouts=layouts(a[1]), use_local_output=a[2] == "1"
        )
    if kind == "output":
        return PrepareModuleOutput(
            output_layouts=layouts(a[0]), desired_output_layouts=layouts(a[1]), use_local_output=a[2] == "1"
        )
    if kind == "inout":
        return PrepareModuleInputOutput(
            input_layouts=layouts(a[0]),
            desired_input_layouts=layouts(a[1]),
            use_local_input=a[2] == "1",
            output_layouts=layouts(a[3]),
            desired_output_layouts=layouts(a[4]),
            use_local_output=a[5] == "1",
        )
    raise ValueError(token)


class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4)

    def forward(self, x):
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class SPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.ffn = nn.LayerNorm(4), FFN()

    def forward(self, x):
        return x + self.ffn(self.norm(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([FFN(), FFN()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def make_model(name):
    parts = name.split("_")
    if parts[0] == "linear" and parts[1] == "nobias":
        m = nn.Linear(int(parts[2]), int(parts[3]), bias=False)
    elif parts[0] == "linear":
        m = nn.Linear(int(parts[1]), int(parts[2]))
    elif parts[0] == "embedding":
        m = nn.Embedding(int(parts[1]), int(parts[2]))
    elif parts[0] == "layernorm":
        m = nn.LayerNorm(int(parts[1]))
    else:
        m = {"ffn": FFN, "sp_block": SPBlock, "stack": Stack}[name]()
    m = m.double()
    with torch.no_grad():
        for fqn, p in m.named_parameters():
            n = p.numel()
            p.copy_((((torch.arange(n) * 7 + len(fqn)) % 13 - 6) / 8).view(p.shape).double())
    return m


def global_values(shape, kind):
    """The global input / output-gradient rule: small exact binary fractions."""
    n = 1
    for s in shape:
        n *= s
    if kind == "ids":
        return ((torch.arange(n) * 3 + 1) % 10).view(shape)
    mod, off, den = (11, 5, 4) if kind == "in" else (5, 2, 2)
    return ((torch.arange(n) % mod - off) / den).double().view(shape)


def split(tensor, layout, world, rank):
    if layout is None or isinstance(layout, Replicate):
        return tensor.clone()
    return torch.chunk(tensor, world, layout.dim % tensor.dim())[rank].clone()


# name, world, model, plan, input global shape, input layout, input kind, output layout
CASES = [
    ("colwise_linear", 2, "linear_4_6", [("", "colwise:-:-:1")], [2, 3, 4], "R", "in", "S(-1)"),
    ("colwise_linear_uneven_to_replicate", 3, "linear_4_7", [("", "colwise:-:R:1")], [2, 3, 4], "R", "in", "R"),
    ("colwise_linear_from_sequence", 2, "linear_4_6", [("", "colwise:S(1):-:1")], [2, 4, 4], "S(1)", "in", "S(-1)"),
    ("colwise_linear_dtensor_output", 2, "linear_nobias_4_10", [("", "colwise:S(1):S(-1):0")], [2, 4, 4], "S(1)", "in",
     "S(-1)"),
    ("rowwise_linear", 2, "linear_6_4", [("", "rowwise:-:-:1")], [2, 3, 6], "S(-1)", "in", "R"),
    ("rowwise_linear_to_sequence", 2, "linear_6_4", [("", "rowwise:-:S(1):1")], [2, 4, 6], "S(-1)", "in", "S(1)"),
    ("rowwise_linear_from_replicate", 3, "linear_6_4", [("", "rowwise:R:-:1")], [2, 3, 6], "R", "in", "R"),
    ("colwise_embedding", 2, "embedding_10_6", [("", "colwise:-:-:1")], [2, 3], "R", "ids", "S(-1)"),
    ("rowwise_embedding", 2, "embedding_10_6", [("", "rowwise:-:-:1")], [2, 3], "R", "ids", "R"),
    ("rowwise_embedding_to_sequence", 2, "embedding_10_6", [("", "rowwise:R:S(1):1")], [2, 4], "R", "ids", "S(1)"),
    ("rowwise_embedding_uneven", 3, "embedding_10_4", [("", "rowwise:R:-:1")], [2, 3], "R", "ids", "R"),
    ("sequence_layernorm", 2, "layernorm_4", [("", "sequence:1:1")], [2, 4, 4], "S(1)", "in", "S(1)"),
    ("sequence_block", 2, "sp_block",
     [("norm", "sequence:1:0"), ("ffn", "input:S(1):R:0"), ("ffn.w1", "colwise:-:-:1"), ("ffn.w2", "colwise:-:-:1"),
      ("ffn.w3", "rowwise:-:S(1):1")], [2, 4, 4], "S(1)", "in", "S(1)"),
    ("prepare_output", 2, "ffn",
     [("", "output:R:S(1):1"), ("w1", "colwise:-:-:1"), ("w2", "colwise:-:-:1"), ("w3", "rowwise:-:-:1")],
     [2, 4, 4], "R", "in", "S(1)"),
    ("prepare_input_output", 2, "ffn",
     [("", "inout:S(1):R:0:R:S(1):1"), ("w1", "colwise:-:-:1"), ("w2", "colwise:-:-:1"), ("w3", "rowwise:-:-:1")],
     [2, 4, 4], "S(1)", "in", "S(1)"),
    ("wildcard_plan", 2, "stack", [("layers.*.w[12]", "colwise:-:-:1"), ("layers.*.w3", "rowwise:-:-:1")],
     [2, 3, 4], "R", "in", "R"),
]

LOSS_CASES = [  # world, N, C, reduction, ignore_index, target
    (2, 6, 10, "mean", -100, [0, 9, 4, 5, 2, 7]),
    (3, 6, 10, "sum", -100, [0, 9, 4, 3, 8, 7]),
    (2, 6, 10, "mean", 3, [3, 9, 4, 5, 3, 1]),
    (3, 6, 10, "none", -100, [1, 9, 4, 6, 2, 0]),
]


def add(golden, *fields):
    """One record: tab-separated fields (testing/golden_file.h reads them)."""
    golden.add("\t".join(fields))


def record(golden, rank, tag, t):
    add(golden, tag, str(rank), gc.ints(t.shape), gc.values(t))


def run_style_case(golden, mode, case):
    name, world, model_name, plan, shape, in_layout, in_kind, out_layout = case
    add(golden, "case", name, str(world), model_name, str('i' if in_kind == 'ids' else 'f'))
    for key, style in plan:
        add(golden, "plan", str(key or '-'), style)
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(model_name)
    parallelize_module(model, mesh, {key: style_of(style) for key, style in plan})
    x_global = global_values(shape, in_kind)
    locals_in = [split(x_global, P(in_layout), world, r) for r in range(world)]
    for r in range(world):
        record(golden, r, "in", locals_in[r])
    x = mode.rank_map(lambda r: locals_in[r])
    if in_kind != "ids":
        x = x.requires_grad_()
    cm = gc.import_comm_debug_mode()()
    with cm:
        y = model(x)
    forward_comms = gc.comm_counts(cm)
    y_local = y.to_local() if isinstance(y, DTensor) else y
    outs = [gc.rank_tensor(y_local, r) for r in range(world)]
    out_p = P(out_layout)
    if isinstance(out_p, Shard):
        d = out_p.dim % outs[0].dim()
        g_shape = list(outs[0].shape)
        g_shape[d] = sum(o.shape[d] for o in outs)
    else:
        g_shape = list(outs[0].shape)
    g_global = global_values(g_shape, "grad")
    grads = [split(g_global, out_p, world, r) for r in range(world)]
    for r in range(world):
        record(golden, r, "outgrad", grads[r])
    g = mode.rank_map(lambda r: grads[r])
    cm = gc.import_comm_debug_mode()()
    with cm:
        if isinstance(y, DTensor):
            y.backward(DTensor.from_local(g, y.device_mesh, y.placements, shape=y.shape, stride=y.stride()))
        else:
            y_local.backward(g)
    add(golden, "comms", "forward", str(forward_comms.replace(' ', ',')))
    add(golden, "comms", "backward", str(gc.comm_counts(cm).replace(' ', ',')))
    for r in range(world):
        record(golden, r, "out", outs[r])
    if in_kind != "ids":
        for r in range(world):
            record(golden, r, "ingrad", gc.rank_tensor(x.grad, r))
    for fqn, p in model.named_parameters():
        grad = p.grad
        placement = "R"
        if isinstance(grad, DTensor):
            placement = gc.placement_token(grad.placements[0])
            grad = grad.full_tensor()
        full = gc.rank_tensor(grad, 0)
        for r in range(1, world):
            if not torch.equal(gc.rank_tensor(grad, r), full):
                raise AssertionError(f"{name}: {fqn}'s full gradient differs across ranks")
        add(golden, "pgrad", fqn, placement, str(gc.ints(full.shape)), str(gc.values(full)))
    golden.records += 1


def run_loss_case(golden, mode, case):
    world, n, c, reduction, ignore_index, target = case
    add(golden, "loss", str(world), str(n), str(c), reduction, str(ignore_index))
    add(golden, "target", str(gc.ints(target)))
    mesh = init_device_mesh("cpu", (world,))
    logits_global = global_values([n, c], "in") * 3
    locals_in = [split(logits_global, Shard(1), world, r) for r in range(world)]
    for r in range(world):
        record(golden, r, "in", locals_in[r])
    local = mode.rank_map(lambda r: locals_in[r]).requires_grad_()
    logits = DTensor.from_local(local, mesh, [Shard(1)], shape=(n, c), stride=(c, 1))
    cm = gc.import_comm_debug_mode()()
    with cm, loss_parallel():
        loss = F.cross_entropy(logits, torch.tensor(target), reduction=reduction, ignore_index=ignore_index)
    forward_comms = gc.comm_counts(cm)
    cm = gc.import_comm_debug_mode()()
    with cm, loss_parallel():
        loss.sum().backward()
    add(golden, "comms", "forward", str(forward_comms.replace(' ', ',')))
    add(golden, "comms", "backward", str(gc.comm_counts(cm).replace(' ', ',')))
    value = loss.full_tensor() if isinstance(loss, DTensor) else loss
    v = gc.rank_tensor(value, 0)
    add(golden, "value", str(gc.ints(v.shape)), str(gc.values(v)))
    for r in range(world):
        record(golden, r, "ingrad", gc.rank_tensor(local.grad, r))
    golden.records += 1


def main():
    gc.quiet_torch()
    start = time.time()
    golden = gc.GoldenFile(GOLDEN, DOC)
    for world in sorted({c[1] for c in CASES} | {c[0] for c in LOSS_CASES}):
        with gc.simulated_world(world) as mode:
            for case in CASES:
                if case[1] == world:
                    run_style_case(golden, mode, case)
            for case in LOSS_CASES:
                if case[0] == world:
                    run_loss_case(golden, mode, case)
    golden.write()
    print(f"gen_tensor_parallel.py: {time.time() - start:.1f} s with torch {torch.__version__}")


if __name__ == "__main__":
    main()
