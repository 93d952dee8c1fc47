"""Golden Hugging Face Llama configs from real transformers: config.json and what it means.

Run with the peer venv's python (`./x golden` does; the peer venv has transformers 5.x). Writes

  models/llama/testdata/golden_hf_configs.txt   read by models/llama/hf_config_test.cc

Each case is the text of a config.json, as transformers' own LlamaConfig(...).to_json_string()
writes it (transformers 5: rope_theta inside rope_parameters) or as older checkpoints on the Hub
have it (rope_theta and rope_scaling at the top level, some keys absent), put on one line, and
the values transformers itself reads from that text (LlamaConfig.from_dict(json.loads(text)),
what from_pretrained does with a config.json). The refused cases are configs transformers takes
but this model cannot compute (biases, another activation, a separate head_dim, ...), with the
key the C++ error must name. Regenerating reproduces the file byte for byte.
"""

import json
import logging
import time

import golden_common as gc
import torch
import transformers
from transformers import LlamaConfig, MistralConfig

GOLDEN = "models/llama/testdata/golden_hf_configs.txt"
DOC = f"""
transformers {transformers.__version__}'s reading of Llama config.json files (testing/golden/gen_models_hf.py); fields
tab-separated:
  config <name> <vocab_size> <hidden_size> <intermediate_size> <num_hidden_layers> <num_attention_heads>
         <num_key_value_heads> <head_dim> <rms_norm_eps> <tie_word_embeddings> <rope_type> <rope_theta>
         <factor> <low_freq_factor> <high_freq_factor> <original_max_position_embeddings> <json>
  refused <name> <key> <json>   a config transformers reads that this model refuses, naming <key>
<json> is the config.json on one line; the llama3 fields are - for rope_type default.
"""

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=131072)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)

# The config.json of meta-llama/Llama-3.1-8B and meta-llama/Llama-3.2-1B on the Hub, as they are
# there (written by transformers 4.4x: rope_theta and rope_scaling at the top level).
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def written(config):
    """What save_pretrained writes to config.json, as a dict."""
    return json.loads(config.to_json_string())


def without(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


def one_line(d):
    text = json.dumps(d, separators=(", ", ": "))
    assert "\t" not in text and "\n" not in text
    return text


def config_cases():
    yield "default", written(LlamaConfig())
    yield "small", written(LlamaConfig(**SMALL))
    yield "small_rope_theta", written(LlamaConfig(**SMALL, rope_theta=123456.0))
    yield "tied", written(LlamaConfig(**SMALL, tie_word_embeddings=True))
    yield "llama3_rope_parameters", written(LlamaConfig(**SMALL, rope_parameters=dict(LLAMA3_ROPE, factor=32.0)))
    # The older keyword arguments, which transformers 5 writes as rope_parameters.
    yield "llama3_rope_scaling_kwargs", written(
        LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=without(LLAMA3_ROPE, "rope_theta")))
    yield "no_kv_heads_no_head_dim", without(written(LlamaConfig(**SMALL)), "num_key_value_heads", "head_dim")
    yield "null_kv_heads", dict(written(LlamaConfig(**SMALL)), num_key_value_heads=None, head_dim=None)
    # transformers takes a non-empty rope_scaling over rope_parameters, and an empty one as none.
    yield "rope_scaling_wins", dict(written(LlamaConfig(**SMALL)), rope_scaling=without(LLAMA3_ROPE, "rope_theta"))
    yield "rope_scaling_empty", dict(written(LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE)), rope_scaling={})
    yield "minimal", {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    yield "hub_llama_3_1_8b", LLAMA_3_1_8B
    yield "hub_llama_3_2_1b", LLAMA_3_2_1B
    # Older form, rope_type as "type"; and a Llama-2-style config: rope_scaling null, rope_theta set.
    legacy = without(LLAMA_3_1_8B, "rope_scaling")
    yield "hub_type_key", dict(legacy, rope_scaling=dict(without(LLAMA_3_1_8B["rope_scaling"], "rope_type"),
                                                          type="llama3"))
    yield "hub_rope_scaling_null", dict(legacy, rope_scaling=None, rope_theta=1000000.0)
    yield "hub_rope_theta_int", dict(legacy, rope_scaling=None, rope_theta=500000)


def refused_cases():
    yield "head_dim", "head_dim", written(LlamaConfig(**SMALL, head_dim=16))
    yield "attention_bias", "attention_bias", written(LlamaConfig(**SMALL, attention_bias=True))
    yield "mlp_bias", "mlp_bias", written(LlamaConfig(**SMALL, mlp_bias=True))
    yield "hidden_act_gelu", "hidden_act", written(LlamaConfig(**SMALL, hidden_act="gelu"))
    yield "model_type_mistral", "model_type", written(MistralConfig(**SMALL))
    yield "rope_linear", "rope_type", written(
        LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}))
    yield "rope_yarn", "rope_type", written(
        LlamaConfig(**SMALL, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 8192}))


def config_line(name, d):
    c = LlamaConfig.from_dict(json.loads(one_line(d)))  # what from_pretrained does with the file
    rope = c.rope_parameters
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    llama3 = ["-"] * 4
    if rope_type == "llama3":
        llama3 = [gc.number(rope["factor"]), gc.number(rope["low_freq_factor"]), gc.number(rope["high_freq_factor"]),
                  str(rope["original_max_position_embeddings"])]
    fields = ["config", name] + [str(v) for v in (c.vocab_size, c.hidden_size, c.intermediate_size,
                                                  c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                                                  c.head_dim)]
    fields += [gc.number(c.rms_norm_eps), str(c.tie_word_embeddings).lower(), rope_type, gc.number(rope["rope_theta"])]
    return "\t".join(fields + llama3 + [one_line(d)])


def main():
    gc.quiet_torch()
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    start = time.time()
    golden = gc.GoldenFile(GOLDEN, DOC)
    for name, d in config_cases():
        golden.add(config_line(name, d))
        golden.records += 1
    for name, key, d in refused_cases():
        LlamaConfig.from_dict(json.loads(one_line(d)))  # transformers takes it
        golden.add("\t".join(["refused", name, key, one_line(d)]))
        golden.records += 1
    golden.write()
    print(f"gen_models_hf.py: {time.time() - start:.1f} s with torch {torch.__version__}, "
          f"transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
