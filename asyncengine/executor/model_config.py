"""ModelConfig: the llama-family shape of a model, parsed from a Hugging Face ``config.json``.

Qwen3 and Gemma are llama with a few differences, carried as plain fields (``qk_norm``,
``norm_weight_offset``, ``activation``, ``embedding_multiplier``) that the forward reads once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "GemmaForCausalLM",
)
# MLP activations by their HF names: SwiGLU, and Gemma's GeGLU with the tanh approximation.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# Windows that the engine does not implement (sliding window ignored when it is off).
_OPTIONAL_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature this executor does not implement."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling, in Hugging Face's vocabulary (``rope_type`` and its parameters)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Family differences from llama (defaults: llama).
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE
    norm_weight_offset: float = 0.0  # Gemma: norms scale by (1 + weight)
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    embedding_multiplier: float | None = None  # Gemma: embeddings times sqrt(hidden_size)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest sequence the positional encoding covers (dynamic NTK stretches it by factor)."""
        if self.rope_scaling.rope_type == "dynamic":
            return int(self.max_position_embeddings * self.rope_scaling.factor)
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse an HF config dict; raise UnsupportedModelError naming the offending field."""
        architectures = d.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise UnsupportedModelError(
                f"unsupported architectures={architectures!r}: expected one of "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        activation = _parse_activation(d, architecture)
        if d.get("mlp_bias", False):
            raise UnsupportedModelError("unsupported mlp_bias=True: MLP projections have no bias")
        _refuse_sliding_window(d, architecture)

        hidden_size = int(d["hidden_size"])
        num_heads = int(d["num_attention_heads"])
        head_dim = int(d.get("head_dim") or hidden_size // num_heads)
        max_pos = int(d.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling = _parse_rope(d, max_pos)

        gemma = architecture == "GemmaForCausalLM"
        if architecture == "Qwen2ForCausalLM":
            attention_bias = True  # Qwen2 always has q/k/v biases; its config does not say so
        else:
            attention_bias = bool(d.get("attention_bias", False))
        eos = d.get("eos_token_id")
        eos_ids = (
            () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        )
        bos = d.get("bos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else int(bos),
            qk_norm=architecture == "Qwen3ForCausalLM",
            norm_weight_offset=1.0 if gemma else 0.0,
            activation=activation,
            embedding_multiplier=hidden_size**0.5 if gemma else None,
        )


def _parse_activation(d: dict[str, Any], architecture: str) -> str:
    # Gemma's files say hidden_act "gelu" but its MLP runs hidden_activation, which HF takes as
    # gelu_pytorch_tanh when missing; transformers 5 writes hidden_act "gelu_pytorch_tanh".
    name = d.get("hidden_act", "silu")
    if architecture == "GemmaForCausalLM":
        name = d.get("hidden_activation") or ("gelu_pytorch_tanh" if name == "gelu" else name)
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"unsupported hidden_act={name!r}: expected one of {', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def _refuse_sliding_window(d: dict[str, Any], architecture: str) -> None:
    window = d.get("sliding_window")
    if window is None:
        return
    if architecture in _OPTIONAL_WINDOW and not d.get("use_sliding_window", False):
        return  # Qwen2/3 carry a window size but only use it when use_sliding_window is true
    if int(window) < int(d.get("max_position_embeddings", 0)):
        raise UnsupportedModelError(
            f"unsupported sliding_window={window}: sliding-window attention is not implemented "
            f"(it would take effect below max_position_embeddings={d.get('max_position_embeddings')})"
        )


def _parse_rope(d: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling]:
    # transformers 5 writes "rope_parameters" (holding rope_theta too); older files "rope_scaling".
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(
            "unsupported rope_parameters nested per layer type: one RoPE for all layers expected"
        )
    rope_theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_type={rope_type!r} (rope_scaling/rope_parameters): expected one of "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedModelError(f"unsupported partial_rotary_factor={partial}: only 1.0")
    if rope_type == "default":
        return rope_theta, RopeScaling()
    if "factor" not in params:
        raise UnsupportedModelError(f"rope_type={rope_type!r} needs rope_scaling.factor")
    factor = float(params["factor"])
    if rope_type != "llama3":
        return rope_theta, RopeScaling(rope_type=rope_type, factor=factor)
    original = params.get(
        "original_max_position_embeddings", d.get("original_max_position_embeddings")
    )
    return rope_theta, RopeScaling(
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original is not None else max_pos,
    )
