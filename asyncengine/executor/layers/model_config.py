"""ModelConfig: the llama-family shape of a model, parsed from a Hugging Face ``config.json``.

Qwen3 and the Gemmas are llama with a few differences, carried as plain fields (``qk_norm``,
``norm_weight_offset``, ``activation``, ``embedding_multiplier``; Gemma 2/3: ``sandwich_norms``,
``attention_scale``, the soft-caps, the sliding layers' own RoPE) that the forward reads once.
Sliding-window layers (Mistral: every layer; Qwen2/3 with ``use_sliding_window``: the layers
from ``max_window_layers`` on; Gemma 2/3: their ``layer_types``) are ``sliding_window`` and
``sliding_layers``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
GEMMAS = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
LAYER_TYPES = ("full_attention", "sliding_attention")
# MLP activations by their HF names: SwiGLU, and Gemma's GeGLU with the tanh approximation.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# Windows by family: Mistral's applies to every layer (transformers' Mistral has no layer
# types); Qwen2/3's only with use_sliding_window, to the layers from max_window_layers on.
_ALL_LAYERS_WINDOW = ("MistralForCausalLM",)
_OPTIONAL_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
_WINDOWED = (*_ALL_LAYERS_WINDOW, *_OPTIONAL_WINDOW, *GEMMAS[1:])
_QWEN_MAX_WINDOW_LAYERS = 28  # transformers' default where a Qwen2/3 config has none
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature this executor does not implement."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling, in Hugging Face's vocabulary (``rope_type`` and its parameters)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin scaled by it


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
    # Gemma 2/3 (defaults: off)
    sandwich_norms: bool = False  # RMSNorm on the attention and MLP outputs before each residual
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before softmax; 0: off
    final_logit_softcap: float = 0.0  # the same on the LM head's logits; 0: off
    sliding_window: int = 0  # keys a query of a sliding layer sees, itself included
    sliding_layers: tuple[bool, ...] = ()  # per layer: True where the window applies
    # Gemma 3: the sliding layers' own RoPE (None: the same as the full layers')
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: RopeScaling | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_window(self, layer: int) -> int:
        """Keys a query of ``layer`` sees, itself included; 0: every earlier key."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else 0

    @property
    def max_model_len(self) -> int:
        """Longest sequence the positional encoding covers, as vLLM counts it: linear scaling
        and dynamic NTK stretch it by factor, YaRN the original length by factor. Gemma 3's
        max_position_embeddings is its context with its linear scaling already counted."""
        return _context(self.max_position_embeddings, self.rope_scaling, self.architecture)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse an HF config dict; raise UnsupportedModelError naming the offending field."""
        architectures = d.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            hint = ""
            if "Gemma3ForConditionalGeneration" in architectures:
                hint = " (multimodal Gemma 3 is not served: text-only Gemma3ForCausalLM is)"
            raise UnsupportedModelError(
                f"unsupported architectures={architectures!r}: expected one of "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}{hint}"
            )
        activation = _parse_activation(d, architecture)
        if d.get("mlp_bias", False):
            raise UnsupportedModelError("unsupported mlp_bias=True: MLP projections have no bias")
        if architecture in GEMMAS[1:] and d.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                "unsupported use_bidirectional_attention=True: causal attention only"
            )
        if architecture not in _WINDOWED:
            _refuse_sliding_window(d, architecture)

        hidden_size = int(d["hidden_size"])
        num_heads = int(d["num_attention_heads"])
        head_dim = int(d.get("head_dim") or hidden_size // num_heads)
        max_pos = int(d.get("max_position_embeddings", 2048))
        gemma = architecture in GEMMAS
        gemma23 = architecture in GEMMAS[1:]
        num_layers = int(d["num_hidden_layers"])
        sliding_rope: tuple[float, RopeScaling] | None = None
        if architecture == "Gemma3ForCausalLM":
            (rope_theta, rope_scaling), sliding_rope = _parse_layer_ropes(d, max_pos)
        else:
            rope_theta, rope_scaling = _parse_rope(d, max_pos)
        window, sliding_layers = _parse_sliding_layers(d, architecture, num_layers)
        if not gemma and window >= _context(max_pos, rope_scaling, architecture):
            # no position reaches past it: plain attention (Gemma 3's sliding layers keep
            # their own RoPE, so Gemmas keep their layer kinds)
            window, sliding_layers = 0, ()
        scalar = d.get("query_pre_attn_scalar") if gemma23 else None
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
            num_layers=num_layers,
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
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            norm_weight_offset=1.0 if gemma else 0.0,
            activation=activation,
            embedding_multiplier=hidden_size**0.5 if gemma else None,
            sandwich_norms=gemma23,
            attention_scale=None if scalar is None else float(scalar) ** -0.5,
            attn_logit_softcap=float(d.get("attn_logit_softcapping") or 0.0) if gemma23 else 0.0,
            final_logit_softcap=float(d.get("final_logit_softcapping") or 0.0) if gemma23 else 0.0,
            sliding_window=window,
            sliding_layers=sliding_layers,
            sliding_rope_theta=None if sliding_rope is None else sliding_rope[0],
            sliding_rope_scaling=None if sliding_rope is None else sliding_rope[1],
        )


def _parse_activation(d: dict[str, Any], architecture: str) -> str:
    # Gemma's files say hidden_act "gelu" but its MLP runs hidden_activation, which HF takes as
    # gelu_pytorch_tanh when missing; transformers 5 writes hidden_act "gelu_pytorch_tanh".
    name = d.get("hidden_act", "silu")
    if architecture in GEMMAS:
        name = d.get("hidden_activation") or ("gelu_pytorch_tanh" if name == "gelu" else name)
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"unsupported hidden_act={name!r}: expected one of {', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def _refuse_sliding_window(d: dict[str, Any], architecture: str) -> None:
    """A family without windows in transformers (which ignores the key there): a window that
    would take effect means the checkpoint expects attention this family does not run."""
    window = d.get("sliding_window")
    if window is None:
        return
    if int(window) < int(d.get("max_position_embeddings", 0)):
        raise UnsupportedModelError(
            f"unsupported sliding_window={window} for {architecture}: sliding-window attention "
            f"runs for {', '.join(_WINDOWED)} only (it would take effect below "
            f"max_position_embeddings={d.get('max_position_embeddings')})"
        )


def _parse_sliding_layers(
    d: dict[str, Any], architecture: str, num_layers: int
) -> tuple[int, tuple[bool, ...]]:
    """The window and which layers it applies to, as transformers builds them: Mistral's every
    layer; Qwen2/3's (with use_sliding_window) ``layer_types``, or the layers from
    ``max_window_layers`` on; Gemma 2/3's ``layer_types``, or HF's default pattern where an
    older config has none (Gemma 2 alternates, Gemma 3 has every ``sliding_window_pattern``-th
    layer full)."""
    window = d.get("sliding_window")
    if architecture not in _WINDOWED or not window:
        return 0, ()
    if architecture in _OPTIONAL_WINDOW and not d.get("use_sliding_window", False):
        return 0, ()  # Qwen2/3 carry a window size but use it only with use_sliding_window
    layer_types = d.get("layer_types")
    if architecture in _ALL_LAYERS_WINDOW:
        layer_types = ["sliding_attention"] * num_layers
    elif layer_types is None:
        layer_types = _default_layer_types(d, architecture, num_layers)
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown or len(layer_types) != num_layers:
        raise UnsupportedModelError(
            f"unsupported layer_types={layer_types!r}: {num_layers} entries of "
            f"{' or '.join(LAYER_TYPES)} expected"
        )
    return int(window), tuple(t == "sliding_attention" for t in layer_types)


def _default_layer_types(d: dict[str, Any], architecture: str, num_layers: int) -> list[str]:
    if architecture in _OPTIONAL_WINDOW:
        first = int(d.get("max_window_layers", _QWEN_MAX_WINDOW_LAYERS))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if architecture == "Gemma2ForCausalLM":
        pattern = 2
    else:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]


def _context(max_pos: int, scaling: RopeScaling, architecture: str) -> int:
    """Longest sequence the positional encoding covers (``ModelConfig.max_model_len``)."""
    if scaling.rope_type == "dynamic" or (
        scaling.rope_type == "linear" and architecture != "Gemma3ForCausalLM"
    ):
        return int(max_pos * scaling.factor)
    if scaling.rope_type == "yarn" and scaling.original_max_position_embeddings is not None:
        return max(max_pos, int(scaling.original_max_position_embeddings * scaling.factor))
    return max_pos


def _parse_layer_ropes(
    d: dict[str, Any], max_pos: int
) -> tuple[tuple[float, RopeScaling], tuple[float, RopeScaling]]:
    """Gemma 3: (full layers' RoPE, sliding layers' RoPE). transformers 5 writes rope_parameters
    per layer type; older files rope_theta + rope_scaling for the full layers and
    rope_local_base_freq for the sliding ones (which never scale)."""
    params = d.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        unknown = sorted(set(params) - set(LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(f"unsupported rope_parameters for layer types {unknown}")
        full = _rope_from_params(params.get("full_attention") or {}, {}, max_pos)
        sliding = _rope_from_params(params.get("sliding_attention") or {}, {}, max_pos)
        return full, sliding
    sliding_theta = float(d.get("rope_local_base_freq", 10000.0))
    return _parse_rope(d, max_pos), (sliding_theta, RopeScaling())


def _parse_rope(d: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling]:
    # transformers 5 writes "rope_parameters" (holding rope_theta too); older files "rope_scaling".
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(
            "unsupported rope_parameters nested per layer type: one RoPE for all layers expected"
        )
    return _rope_from_params(params, d, max_pos)


def _rope_from_params(
    params: dict[str, Any], d: dict[str, Any], max_pos: int
) -> tuple[float, RopeScaling]:
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
    if rope_type in ("linear", "dynamic"):
        return rope_theta, RopeScaling(rope_type=rope_type, factor=factor)
    # HF prefers a config's own original_max_position_embeddings (Phi-3 keeps it there)
    original = d.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings"
    )
    if rope_type == "yarn":
        return rope_theta, _yarn(params, factor, int(original or max_pos))
    return rope_theta, RopeScaling(
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original is not None else max_pos,
    )


def _yarn(params: dict[str, Any], factor: float, original: int) -> RopeScaling:
    """YaRN's parameters with HF's defaults; the attention factor from mscale / mscale_all_dim
    (DeepSeek's form) or the factor alone where the config does not give it."""
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
