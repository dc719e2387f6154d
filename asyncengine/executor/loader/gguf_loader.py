"""Read a GGUF file (llama.cpp's format) of a llama, qwen2, qwen3, gemma2 or gemma3 model as a
Hugging Face checkpoint.

Every tensor is dequantized to the target dtype and renamed to its HF name; what llama.cpp's
converter changes is undone: the row permutation of llama's q_proj/k_proj (for its interleaved
RoPE), so the weights run with HF's rotate-half RoPE, and the 1 it adds to every Gemma norm
weight (HF's Gemma norms scale by 1 + weight). The config, generation config and tokenizer come
from the file's metadata, with what the file does not store (Gemma's sliding-layer pattern and
attention scale) set as llama.cpp sets it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import Tokenizer

from asyncengine.executor.loader.gguf_file import GGUFFile, read_gguf_file
from asyncengine.executor.loader.gguf_rope import llama3_rope_parameters
from asyncengine.executor.loader.gguf_tokenizer import build_tokenizer, tokenizer_config
from asyncengine.executor.loader.gguf_widen import WIDENED_TYPES, as_q8_0, widening_available
from asyncengine.executor.loader.hf_dir import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    SINGLE_WEIGHTS_FILE,
    ModelFilesError,
)
from asyncengine.executor.loader.progress import format_bytes, log, progress
from asyncengine.kernels.quant_formats import GGUF_FORMATS, Q8_0, QuantFormat, QuantizedTensor

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True, slots=True)
class GGUFArchitecture:
    """How llama.cpp's converter writes one HF architecture."""

    hf_architecture: str
    model_type: str  # HF's, for config.json
    permuted_qk: bool = False  # llama only: the others run NEOX RoPE, HF's rotate-half order
    norm_shift: float = 0.0  # added to every norm weight (Gemma: HF's 1 + weight, stored whole)
    sandwich_norms: bool = False  # Gemma 2/3: ffn_norm is HF's pre_feedforward_layernorm


SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3"),
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", "gemma2", norm_shift=1.0, sandwich_norms=True),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM", "gemma3_text", norm_shift=1.0, sandwich_norms=True
    ),
}
# What llama.cpp sets for Gemma 2/3 where the file says nothing: Gemma 2's window and soft-caps,
# Gemma 3's sliding-layer pattern (every 6th layer full) and sliding layers' RoPE base.
_GEMMA2_DEFAULTS = {
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_SLIDING_ROPE_BASE = 10000.0
# llama.cpp scales a Gemma 2/3 27B's queries by (hidden / heads) ** -0.5, others' by
# head_dim ** -0.5 (HF's query_pre_attn_scalar); it tells a 27B by its layer count
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# YaRN's parameters as llama.cpp's converter writes them (rope.scaling.*) -> HF's names
_YARN_KEYS = (
    ("yarn_beta_fast", "beta_fast"),
    ("yarn_beta_slow", "beta_slow"),
    ("yarn_attn_factor", "attention_factor"),
)

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2/3 norm the attention and MLP outputs too: HF's post_attention_layernorm is then the
# attention output's, and the MLP's input norm (GGUF's ffn_norm) pre_feedforward_layernorm
_SANDWICH_BLOCK_TENSORS = {
    **_BLOCK_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
Weight = torch.Tensor | QuantizedTensor  # a dense tensor, or a GGUF tensor kept as stored
_BLOCK_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(slots=True)
class GGUFCheckpoint:
    """A GGUF file's content, in Hugging Face terms."""

    config: dict[str, Any]
    generation_config: dict[str, Any]
    weights: dict[str, Weight]
    tokenizer: Tokenizer
    tokenizer_config: dict[str, Any]


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field, as Python values (token lists included)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def rope_factors(file: GGUFFile) -> list[float] | None:
    """The rope_freqs tensor's values (per-frequency RoPE divisors), None if the file has none."""
    tensor = file.tensor(ROPE_FREQS_TENSOR)
    if tensor is None:
        return None
    return [float(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]


def gguf_architecture(metadata: dict[str, Any]) -> tuple[str, GGUFArchitecture]:
    """The file's general.architecture and how it is read; ModelFilesError for other ones."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelFilesError(
            f"GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    return arch, SUPPORTED_GGUF_ARCHITECTURES[arch]


def hf_name(gguf_name: str, arch: GGUFArchitecture = SUPPORTED_GGUF_ARCHITECTURES["llama"]) -> str:
    """The HF parameter name of a GGUF tensor name; ModelFilesError for unknown ones."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS and suffix in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    blocks = _SANDWICH_BLOCK_TENSORS if arch.sandwich_norms else _BLOCK_TENSORS
    match = _BLOCK_TENSOR_NAME.fullmatch(gguf_name)
    if match and match.group(2) in blocks:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{blocks[part]}.{suffix}"
    raise ModelFilesError(f"GGUF tensor {gguf_name!r} has no {arch.hf_architecture} counterpart")


def unpermute_rope_rows(weight: Weight, num_heads: int) -> Weight:
    """Undo llama.cpp's q/k row permutation.

    Its converter turns each head's rows [first half | second half] (HF's rotate-half pairs
    i, i + d/2) into interleaved pairs (2i, 2i+1); reading the rows back as (pair, 2) and
    swapping the two axes restores HF's order. Done as one row gather (whole rows are copied;
    a quantized weight's rows are its blocks, so nothing is dequantized).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    if half * 2 * num_heads != rows:
        raise ModelFilesError(f"{rows} rows do not split into {num_heads} heads of even size")
    source_rows = torch.arange(rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(rows)
    if isinstance(weight, QuantizedTensor):
        return weight.select_rows(source_rows)
    return weight.index_select(0, source_rows)


def _float32_decimal(value: float) -> float:
    """The shortest decimal that rounds to this float32 (1e-05, not 9.999999747378752e-06): the
    value the original config.json held before GGUF stored it as float32."""
    return float(str(np.float32(value)))


def hf_config(
    metadata: dict[str, Any],
    tensor_names: set[str],
    dtype: torch.dtype,
    rope_factors: Sequence[float] | None = None,
) -> dict[str, Any]:
    """An HF config.json dict from the <arch>.* metadata keys (``rope_factors``: the file's
    rope_freqs tensor, Llama 3's RoPE scaling)."""
    arch, spec = gguf_architecture(metadata)

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelFilesError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = metadata.get(f"{arch}.attention.key_length") or metadata.get(
        f"{arch}.rope.dimension_count", hidden_size // num_heads
    )
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = metadata.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        raise ModelFilesError(f"GGUF metadata has neither {arch}.vocab_size nor a token list")
    rope_theta = _float32_decimal(key("rope.freq_base", 10000.0))
    rope_parameters = _rope_parameters(metadata, arch, rope_theta, int(head_dim), rope_factors)
    config = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _float32_decimal(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": rope_parameters,
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": any(name.endswith("attn_q.bias") for name in tensor_names),
        "mlp_bias": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "dtype": str(dtype).removeprefix("torch."),
    }
    if arch in ("gemma2", "gemma3"):
        config.update(_gemma_config(metadata, arch, config))
    return config


def _rope_parameters(
    metadata: dict[str, Any],
    arch: str,
    rope_theta: float,
    head_dim: int,
    rope_factors: Sequence[float] | None,
) -> dict[str, Any]:
    """HF's rope_parameters: Llama 3's from the rope_freqs factors, others' from the
    rope.scaling.* keys."""
    if rope_factors is not None:
        return llama3_rope_parameters(rope_factors, rope_theta, head_dim)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return rope_parameters
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if factor is None:
        raise ModelFilesError(f"GGUF metadata lacks {arch}.rope.scaling.factor")
    rope_parameters["rope_type"] = scaling_type
    rope_parameters["factor"] = float(factor)
    if original := metadata.get(f"{arch}.rope.scaling.original_context_length"):
        rope_parameters["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in _YARN_KEYS:
        if (value := metadata.get(f"{arch}.rope.scaling.{gguf_key}")) is not None:
            rope_parameters[hf_key] = _float32_decimal(value)
    return rope_parameters


def _gemma_config(metadata: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3's config keys: GeGLU, the attention scale, soft-caps, the sliding layers and
    (Gemma 3) their own RoPE base."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    is_27b = layers == _GEMMA_27B_LAYERS[arch]
    defaults: dict[str, Any] = _GEMMA2_DEFAULTS if arch == "gemma2" else {}
    window = metadata.get(f"{arch}.attention.sliding_window", defaults.get("sliding_window"))
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // heads if is_27b else config["head_dim"],
        "final_logit_softcapping": metadata.get(
            f"{arch}.final_logit_softcapping", defaults.get("final_logit_softcapping")
        ),
        "sliding_window": int(window) if window else None,
    }
    if arch == "gemma2":
        out["attn_logit_softcapping"] = metadata.get(
            f"{arch}.attn_logit_softcapping", defaults["attn_logit_softcapping"]
        )
        pattern: Any = 2
    else:
        pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
        sliding_base = metadata.get(f"{arch}.rope.freq_base_swa", _GEMMA3_SLIDING_ROPE_BASE)
        out["rope_parameters"] = {
            "full_attention": config["rope_parameters"],
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": _float32_decimal(sliding_base),
            },
        }
    out["layer_types"] = _layer_types(pattern if window else 1, layers)
    return out


def _layer_types(pattern: int | Sequence[bool], layers: int) -> list[str]:
    """HF's layer_types from llama.cpp's sliding_window_pattern: per layer (True: sliding), or
    n: every n-th layer full, the others sliding (1: every layer full)."""
    if isinstance(pattern, int):
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    else:
        sliding = [bool(flag) for flag in pattern]
        if len(sliding) != layers:
            raise ModelFilesError(
                f"GGUF sliding_window_pattern has {len(sliding)} entries for {layers} layers"
            )
    return ["sliding_attention" if flag else "full_attention" for flag in sliding]


def generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: BOS/PAD and every end-of-generation id the file names."""
    eos_ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = metadata.get(f"tokenizer.ggml.{name}")
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(int(token_id))
    config: dict[str, Any] = {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    return {key: value for key, value in config.items() if value is not None}


def _tensor_to_torch(data: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    array = np.asarray(data, dtype=np.float32).reshape(shape)
    if not array.flags.writeable:  # F32 tensors come back as views of the read-only file map
        array = array.copy()
    return torch.from_numpy(array).to(dtype)


def _quantized(data: np.ndarray, fmt: QuantFormat, shape: tuple[int, ...]) -> QuantizedTensor:
    """The blocks as stored: a view of the file's map (read_gguf_file), copied by whatever
    reorders them (q/k unpermuting, merged projections, interleaved groups) and by nothing else."""
    rows, cols = shape
    raw = torch.from_numpy(np.asarray(data, dtype=np.uint8)).reshape(rows, -1)
    return QuantizedTensor(fmt, raw, cols)


def _widened(
    tensor_type: GGMLQuantizationType, keep_types: frozenset[int], shape: tuple[int, ...]
) -> bool:
    """Whether a tensor is kept as Q8_0 blocks of its exact values (gguf_widen.py)."""
    return (
        tensor_type in WIDENED_TYPES
        and int(GGMLQuantizationType.Q8_0) in keep_types
        and len(shape) == 2
        and widening_available()
    )


def read_gguf(
    path: str | Path, dtype: torch.dtype, keep_types: frozenset[int] = frozenset()
) -> GGUFCheckpoint:
    """The whole file in HF names and layout, on CPU: 2-D tensors whose GGUF type is in
    ``keep_types`` stay as stored (QuantizedTensor), every other tensor is dequantized to dtype
    (one log line names the quantized types that were)."""
    path = Path(path)
    reader = read_gguf_file(path)
    config, weights = read_gguf_weights(path, dtype, keep_types, reader)
    return GGUFCheckpoint(
        config=config,
        generation_config=generation_config(reader.metadata),
        weights=weights,
        tokenizer=build_tokenizer(reader.metadata, path),
        tokenizer_config=tokenizer_config(reader.metadata, config["max_position_embeddings"]),
    )


def read_gguf_weights(
    path: str | Path,
    dtype: torch.dtype,
    keep_types: frozenset[int] = frozenset(),
    reader: GGUFFile | None = None,
) -> tuple[dict[str, Any], dict[str, Weight]]:
    """``read_gguf``'s config and weights alone: what a load needs once the tokenizer files are
    in the model's metadata directory (building the tokenizer from a 128k vocabulary takes
    longer than reading a 1B model's quantized tensors)."""
    path = Path(path)
    start = time.perf_counter()
    reader = reader if reader is not None else read_gguf_file(path)
    metadata = reader.metadata
    names = {tensor.name for tensor in reader.tensors}
    config = hf_config(metadata, names, dtype, rope_factors(reader))
    _, spec = gguf_architecture(metadata)
    heads_of = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    if not spec.permuted_qk:
        heads_of = {}

    weights: dict[str, Weight] = {}
    dequantized_types: dict[str, int] = {}
    tensors = progress(
        reader.tensors,
        f"converting {path.name}",
        total=len(reader.tensors),
        size=lambda tensor: int(tensor.n_elements),  # dequantizing costs per element
    )
    for tensor in tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue  # read into the config's RoPE parameters
        name = hf_name(tensor.name, spec)
        # GGUF lists dimensions innermost first.
        shape = tuple(int(n) for n in reversed(tensor.shape))
        # A plain ndarray view: slicing np.memmap objects inside dequantize is twice as slow.
        raw = np.asarray(tensor.data)
        fmt = GGUF_FORMATS.get(int(tensor.tensor_type))
        weight: Weight
        if fmt is not None and int(tensor.tensor_type) in keep_types and len(shape) == 2:
            weight = _quantized(raw, fmt, shape)
        elif _widened(tensor.tensor_type, keep_types, shape):
            weight = _quantized(as_q8_0(raw, tensor.tensor_type, shape[0]), Q8_0, shape)
        else:
            if tensor.tensor_type not in _FLOAT_TYPES:
                type_name = tensor.tensor_type.name
                dequantized_types[type_name] = dequantized_types.get(type_name, 0) + 1
            values = dequantize(raw, tensor.tensor_type)
            if spec.norm_shift and tensor.name.endswith("norm.weight"):
                values = np.asarray(values, dtype=np.float32) - np.float32(spec.norm_shift)
            weight = _tensor_to_torch(values, shape, dtype)
        match = _BLOCK_TENSOR_NAME.fullmatch(tensor.name)
        if match and match.group(2) in heads_of:
            weight = unpermute_rope_rows(weight, heads_of[match.group(2)])
        weights[name] = weight

    total_bytes = sum(w.nbytes for w in weights.values())
    kept = sum(isinstance(w, QuantizedTensor) for w in weights.values())
    if keep_types and dequantized_types:
        log.info(
            "%s: no native kernel for %s: those tensors are dequantized to %s",
            path.name,
            ", ".join(f"{name} ({count})" for name, count in sorted(dequantized_types.items())),
            str(dtype).removeprefix("torch."),
        )
    log.info(
        "read %s (%s on disk): %d tensors, %d kept quantized, the rest as %s (%s) in %.2f s",
        path.name,
        format_bytes(path.stat().st_size),
        len(weights),
        kept,
        str(dtype).removeprefix("torch."),
        format_bytes(total_bytes),
        time.perf_counter() - start,
    )
    return config, weights


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_hf_dir(checkpoint: GGUFCheckpoint, out_dir: Path) -> None:
    """Write the checkpoint as an HF directory transformers can also load."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / CONFIG_FILE, checkpoint.config)
    _write_json(out_dir / GENERATION_CONFIG_FILE, checkpoint.generation_config)
    _write_json(out_dir / TOKENIZER_CONFIG_FILE, checkpoint.tokenizer_config)
    checkpoint.tokenizer.save(str(out_dir / TOKENIZER_FILE))
    dense = {k: w for k, w in checkpoint.weights.items() if isinstance(w, torch.Tensor)}
    if len(dense) != len(checkpoint.weights):
        raise ValueError("an HF directory holds dense tensors: read the GGUF without keep_types")
    save_file(dense, str(out_dir / SINGLE_WEIGHTS_FILE), metadata={"format": "pt"})


def write_tokenizer_dir(
    gguf_path: str | Path, out_dir: str | Path, with_config: bool = False
) -> None:
    """Only the tokenizer files (tokenizer.json, tokenizer_config.json, generation_config.json),
    and with ``with_config`` config.json: reads the metadata, dequantizes nothing."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = read_gguf_file(gguf_path)
    metadata = reader.metadata
    if with_config:
        names = {tensor.name for tensor in reader.tensors}
        out_dir.mkdir(parents=True, exist_ok=True)
        config = hf_config(metadata, names, torch.float32, rope_factors(reader))
        _write_json(out_dir / CONFIG_FILE, config)
    context_length = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / GENERATION_CONFIG_FILE, generation_config(metadata))
    tokenizer_settings = tokenizer_config(metadata, context_length)
    # checked here, where the error can name the GGUF, not the cache's copy of its template
    # (imported here: text.tokenizer reads its files through this package)
    from asyncengine.text.tokenizer import compile_chat_template

    compile_chat_template(
        tokenizer_settings.get("chat_template"), f"{gguf_path} (tokenizer.chat_template)"
    )
    _write_json(out_dir / TOKENIZER_CONFIG_FILE, tokenizer_settings)
    build_tokenizer(metadata, gguf_path).save(str(out_dir / TOKENIZER_FILE))


def convert_gguf_to_hf_dir(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype) -> None:
    start = time.perf_counter()
    write_hf_dir(read_gguf(gguf_path, dtype), Path(out_dir))
    log.info(
        "converted %s to %s in %.2f s", Path(gguf_path).name, out_dir, time.perf_counter() - start
    )
