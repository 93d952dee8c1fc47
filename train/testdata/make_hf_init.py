"""Writes a small Llama 3 with Hugging Face transformers' own initialization, as save_pretrained
writes it (config.json + model.safetensors): the starting point of `./x demo`'s trainer part
(train/configs/demo.toml). Deterministic (seeded).

usage: make_hf_init.py OUT_DIR
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,  # the shipped corpus's tokenizer
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )
    LlamaForCausalLM(config).save_pretrained(sys.argv[1])
    print(f"wrote {sys.argv[1]}: transformers' LlamaForCausalLM, {config.num_hidden_layers} layers, "
          f"hidden {config.hidden_size}, {config.num_attention_heads} heads / {config.num_key_value_heads} kv heads")


if __name__ == "__main__":
    main()
