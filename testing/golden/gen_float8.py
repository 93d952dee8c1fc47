"""Golden float8 corpus from real torchao 0.18 (torchao/float8/) on PyTorch 2.15, CPU.

Run with the peer venv's python (`./x golden` does). Writes

  float8/testdata/golden_float8.txt     read by float8/float8_test.cc

Records (tab-separated):

  linear NAME RECIPE EMULATE PAD DTYPE IN_SHAPE OUT_FEATURES INPUT WEIGHT BIAS GRAD_OUTPUT
         OUTPUT GRAD_INPUT GRAD_WEIGHT GRAD_BIAS
      one torchao Float8Linear (Float8Linear.from_float of an nn.Linear with the recipe's
      Float8LinearConfig, emulate / pad_inner_dim set) run forward on INPUT and backward with
      GRAD_OUTPUT; tensors are row-major value lists, `-` for no bias;
  repr RECIPE EXTRA_REPR
      the resolved cast configs as Float8Linear.extra_repr prints them (torchao appends a
      stray '"', dropped here);
  filter KIND N K FQN SELECTED
      whether a Linear of weight [N, K] named FQN is converted: KIND `titan` is torchtitan's
      module_filter_fn with filter_fqns ["output"], `tensorwise` / `rowwise` torchao's
      _auto_filter_for_recipe with the same filter_fqns.

Inputs are seeded; each input has an outlier so that tensorwise and rowwise scales differ.
Regenerating reproduces the file byte for byte.
"""

import copy

import golden_common as gc
import torch
from torch import nn
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_linear_utils import _auto_filter_for_recipe
from torchtitan.components.quantization.utils import module_filter_fn
from torchtitan.models.common.linear import Linear

GOLDEN = "float8/testdata/golden_float8.txt"
DOC = __doc__.split("Records (tab-separated):")[1].split("Inputs are seeded")[0]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# (name, recipe, emulate, pad_inner_dim, dtype, input shape, out_features, bias)
CASES = [(f"{r}_{d}", r, False, False, d, (2, 3, 32), 16, True) for r in RECIPES for d in DTYPES]
CASES += [
    ("tensorwise_nobias", "tensorwise", False, False, "float32", (4, 32), 48, False),
    ("rowwise_2d", "rowwise", False, False, "float32", (5, 48), 32, False),
    ("emulate_float32", "tensorwise", True, False, "float32", (2, 3, 32), 16, True),
    ("emulate_bfloat16", "tensorwise", True, False, "bfloat16", (2, 3, 32), 16, True),
    ("pad_inner_dim", "tensorwise", False, True, "float32", (3, 40), 16, True),
]

FILTER_SHAPES = [(16, 32), (32, 24), (1024, 4096), (1040, 4096), (2048, 2048), (4096, 2048), (4112, 2064),
                 (8192, 4096), (2064, 1040)]
FILTER_FQNS = ["layers.0.attention.wq", "output", "layers.1.feed_forward.w1"]


def config_for(recipe, emulate, pad):
    c = Float8LinearConfig.from_recipe_name(recipe)
    fields = {f: getattr(c, f) for f in c.__dataclass_fields__}
    fields.update(emulate=emulate, pad_inner_dim=pad)
    return Float8LinearConfig(**fields)


def linear_record(case_index, name, recipe, emulate, pad, dtype_name, in_shape, out_features, bias):
    dtype = DTYPES[dtype_name]
    torch.manual_seed(case_index)
    k = in_shape[-1]
    lin = nn.Linear(k, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, k) * 0.2)
        lin.weight[0, 1] = 3.0
        if bias:
            lin.bias.copy_(torch.randn(out_features) * 0.1)
    x = (torch.randn(in_shape) * 2).to(dtype)
    x.view(-1)[1] = 40.0
    x.requires_grad_()
    go = torch.randn(*in_shape[:-1], out_features).to(dtype)
    go.view(-1)[2] = -9.0
    m = Float8Linear.from_float(copy.deepcopy(lin), config=config_for(recipe, emulate, pad))
    y = m(x)
    y.backward(go)
    fields = ["linear", name, recipe, str(int(emulate)), str(int(pad)), dtype_name, gc.ints(in_shape),
              str(out_features), gc.values(x), gc.values(lin.weight), gc.values(lin.bias) if bias else "-",
              gc.values(go), gc.values(y), gc.values(x.grad), gc.values(m.weight.grad),
              gc.values(m.bias.grad) if bias else "-"]
    return "\t".join(fields)


def main():
    gc.quiet_torch()
    golden = gc.GoldenFile(GOLDEN, DOC)
    for i, case in enumerate(CASES):
        golden.add(linear_record(i, *case))
        golden.records += 1
    for recipe in RECIPES:
        m = Float8Linear.from_float(nn.Linear(32, 16), config=Float8LinearConfig.from_recipe_name(recipe))
        golden.add("\t".join(["repr", recipe, m.extra_repr().rstrip('"')]))
        golden.records += 1
    for n, k in FILTER_SHAPES:
        for fqn in FILTER_FQNS:
            config = Linear.Config(in_features=k, out_features=n)
            golden.add("\t".join(["filter", "titan", str(n), str(k), fqn,
                                  str(int(module_filter_fn(config, fqn, ["output"])))]))
            for recipe in ("tensorwise", "rowwise"):
                selected = _auto_filter_for_recipe(recipe, ["output"])(nn.Linear(k, n, device="meta"), fqn)
                golden.add("\t".join(["filter", recipe, str(n), str(k), fqn, str(int(selected))]))
            golden.records += 3
    golden.write()


if __name__ == "__main__":
    main()
