"""Random-weight llama-family models of real shapes in GGUF block formats, made in process (no
GGUF file, no llama.cpp): for the micro-benchmarks of kernels/cpu, whose speed depends on the
shapes and formats, not on the values.

``llama_quantize_mix`` follows llama-quantize's choice of formats per tensor for the mixes
(Q4_K_M: Q4_K, with v and down in Q6_K on the layers it gives more bits, and the output /
tied embedding in Q6_K; Q5_K_M the same over Q5_K); blocks are random bytes with small valid
fp16 scales (scripts/micro/bench_quant_matmul.py's ``random_blocks``).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncengine.kernels.quant_formats import QuantizedTensor

# Hugging Face config.json fields of each shape
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
    },
    "llama-3.2-3b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
    },
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
    },
}  # fmt: skip
MIXES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0")


def _more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighth of the layers, every third
    between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def llama_quantize_mix(mix: str, tensor: str, layer: int, layers: int) -> str:
    """The format of one tensor (``tensor``: q, k, v, o, gate, up, down, embed) in ``mix``."""
    if mix in ("Q6_K", "Q8_0", "Q4_0"):
        return mix if tensor != "embed" or mix != "Q4_0" else "Q6_K"
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}[mix]
    if tensor == "embed":
        return "Q6_K"
    if tensor in ("v", "down") and _more_bits(layer, layers):
        return "Q6_K"
    return base


def synthetic_weights(shape: str, mix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json fields, weights by Hugging Face name) of a random model of this shape."""
    from scripts.micro.bench_quant_matmul import random_blocks

    config = dict(SHAPES[shape])
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    layers = config["num_hidden_layers"]
    weights: dict[str, Any] = {}

    def blocks(tensor: str, layer: int, rows: int, cols: int) -> QuantizedTensor:
        return random_blocks(llama_quantize_mix(mix, tensor, layer, layers), rows, cols)

    weights["model.embed_tokens.weight"] = blocks("embed", 0, config["vocab_size"], hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    for i in range(layers):
        prefix = f"model.layers.{i}."
        attn = {
            "q": (heads * head_dim, hidden),
            "k": (kv_heads * head_dim, hidden),
            "v": (kv_heads * head_dim, hidden),
            "o": (hidden, heads * head_dim),
        }
        for name, (rows, cols) in attn.items():
            weights[f"{prefix}self_attn.{name}_proj.weight"] = blocks(name, i, rows, cols)
            if config["model_type"] == "qwen2" and name != "o":
                weights[f"{prefix}self_attn.{name}_proj.bias"] = torch.zeros(rows)
        mlp = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        for name, (rows, cols) in mlp.items():
            weights[f"{prefix}mlp.{name}_proj.weight"] = blocks(name, i, rows, cols)
        weights[f"{prefix}input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{prefix}post_attention_layernorm.weight"] = torch.ones(hidden)
    return config, weights
