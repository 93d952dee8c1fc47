"""Golden model corpus from real torchtitan: the Llama-3 registry and its initialization.

Run with the peer venv's python (`./x golden` does; the peer venv has torchtitan 0.3.0). Writes

  models/llama/testdata/golden_llama3_flavors.txt   read by models/llama/model_test.cc

from torchtitan's own model configs (torchtitan/models/llama3/__init__.py, llama3_configs),
built without building a model. Regenerating reproduces the file byte for byte.
"""

import functools
import time

import golden_common as gc
import torch
import torchtitan
from torchtitan.models.llama3 import llama3_configs

GOLDEN = "models/llama/testdata/golden_llama3_flavors.txt"
DOC = f"""
torchtitan {torchtitan.__version__}'s Llama-3 flavors (testing/golden/gen_models.py); fields tab-separated:
  flavor <name> <dim> <n_layers> <n_heads> <n_kv_heads> <vocab_size> <ffn_hidden_dim> <rope_theta>
         <rope_scaling> <scaling_factor> <low_freq_factor> <high_freq_factor>
         <original_max_position_embeddings> <norm_eps> <weight_tying>
  init <name> <param> <fn> <std> <a> <b>   the weight init of <param> (HF names; layer i as
                                             model.layers.<i>); fn normal / trunc_normal / ones /
                                             skip; a, b: the cut (trunc_normal's defaults -2, 2)
  flops <name> <seq_len> <nparams> <flops_per_token>   Llama3Model.Config.get_nparams_and_flops
                                             of the flavor's model (built on the meta device)
n_kv_heads None is written as n_heads (what GQA then uses).
"""

# torchtitan's module -> the HF name of the same weight (torchtitan/models/llama3/state_dict_adapter.py).
LAYER_WEIGHTS = {
    ("feed_forward", "w1"): "mlp.gate_proj.weight",
    ("feed_forward", "w2"): "mlp.down_proj.weight",
    ("feed_forward", "w3"): "mlp.up_proj.weight",
    ("attention", "wo"): "self_attn.o_proj.weight",
}


def describe(init):
    """fn, std, a, b of a param_init entry."""
    if isinstance(init, functools.partial):
        name = init.func.__name__.rstrip("_")
        kw = init.keywords
        if name == "trunc_normal":
            return name, kw.get("std", 1.0), kw.get("a", -2.0), kw.get("b", 2.0)
        if name == "normal":
            return name, kw.get("std", 1.0), "-", "-"
    name = getattr(init, "__name__", "")
    if name == "ones_":
        return "ones", "-", "-", "-"
    if name == "skip_param_init":
        return "skip", "-", "-", "-"
    # The fused q/k/v init: a closure over the per-projection partial.
    for cell in init.__closure__ or ():
        contents = cell.cell_contents
        if isinstance(contents, dict) and "weight" in contents:
            return describe(contents["weight"])
        if isinstance(contents, functools.partial):
            return describe(contents)
    raise TypeError(f"unknown init {init!r}")


def init_line(golden, flavor, param, init):
    fn, std, a, b = describe(init)
    golden.add("\t".join(["init", flavor, param, fn] + [v if isinstance(v, str) else gc.number(v) for v in (std, a, b)]))


def main():
    gc.quiet_torch()
    start = time.time()
    golden = gc.GoldenFile(GOLDEN, DOC)
    for name, build in llama3_configs.items():
        c = build(attn_backend="flex")
        layer0 = c.layers[0]
        attn, rope = layer0.attention, layer0.attention.rope
        golden.add(
            "\t".join(
                ["flavor", name]
                + [str(v) for v in (c.dim, len(c.layers), attn.n_heads, attn.n_kv_heads or attn.n_heads, c.vocab_size,
                                    layer0.feed_forward.w1.out_features)]
                + [gc.number(rope.theta), rope.scaling, gc.number(rope.scaling_factor), gc.number(rope.low_freq_factor),
                   gc.number(rope.high_freq_factor), str(rope.original_max_position_embeddings),
                   gc.number(layer0.attention_norm.eps), str(c.enable_weight_tying).lower()]
            )
        )
        init_line(golden, name, "model.embed_tokens.weight", c.tok_embeddings.param_init["weight"])
        init_line(golden, name, "model.norm.weight", c.norm.param_init["weight"])
        init_line(golden, name, "lm_head.weight", c.lm_head.param_init["weight"])
        for i in sorted({0, 1, len(c.layers) - 1}):
            layer = c.layers[i]
            prefix = f"model.layers.{i}."
            init_line(golden, name, prefix + "input_layernorm.weight", layer.attention_norm.param_init["weight"])
            init_line(golden, name, prefix + "post_attention_layernorm.weight", layer.ffn_norm.param_init["weight"])
            qkv_init = layer.attention.qkv_linear.wqkv.param_init["weight"]
            for proj in ("q_proj", "k_proj", "v_proj"):
                init_line(golden, name, prefix + f"self_attn.{proj}.weight", qkv_init)
            for (module, weight), hf in LAYER_WEIGHTS.items():
                init_line(golden, name, prefix + hf, getattr(getattr(layer, module), weight).param_init["weight"])
        with torch.device("meta"):
            model = c.build()
        for seq_len in (512, 2048, 8192):
            nparams, flops = c.get_nparams_and_flops(model, seq_len)
            golden.add("\t".join(["flops", name, str(seq_len), str(nparams), str(flops)]))
        golden.records += 1
    golden.write()
    print(f"gen_models.py: {time.time() - start:.1f} s with torch {torch.__version__}, torchtitan {torchtitan.__version__}")


if __name__ == "__main__":
    main()
