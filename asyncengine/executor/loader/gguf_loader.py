"""Read a llama GGUF file (llama.cpp's format) as a Hugging Face checkpoint.

Every tensor is dequantized to the target dtype and renamed to its HF name; the row permutation
llama.cpp's converter applies to q_proj/k_proj (for its interleaved RoPE) is undone, so the
weights run with HF's rotate-half RoPE. The config, generation config and tokenizer come from
the file's metadata.
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
from asyncengine.executor.loader.hf_dir import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    SINGLE_WEIGHTS_FILE,
    ModelFilesError,
)
from asyncengine.executor.loader.progress import format_bytes, log, progress
from asyncengine.kernels.quant_formats import GGUF_FORMATS, QuantFormat, QuantizedTensor

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# GGUF architecture -> HF architecture; llama.cpp permutes q/k rows for llama only (qwen2 runs
# its NEOX RoPE, HF's rotate-half order, as stored)
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_PERMUTED_QK_ARCHITECTURES = ("llama",)
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
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
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


def hf_name(gguf_name: str) -> str:
    """The HF llama parameter name of a GGUF tensor name; ModelFilesError for unknown ones."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS and suffix in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    match = _BLOCK_TENSOR_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_TENSORS:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{_BLOCK_TENSORS[part]}.{suffix}"
    raise ModelFilesError(f"GGUF tensor {gguf_name!r} has no llama counterpart")


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
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelFilesError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )

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
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if rope_factors is not None:
        rope_parameters = llama3_rope_parameters(rope_factors, rope_theta, int(head_dim))
    elif scaling_type not in (None, "none"):
        rope_parameters["rope_type"] = scaling_type
        rope_parameters["factor"] = float(key("rope.scaling.factor"))
        if original := metadata.get(f"{arch}.rope.scaling.original_context_length"):
            rope_parameters["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in _YARN_KEYS:
            if (value := metadata.get(f"{arch}.rope.scaling.{gguf_key}")) is not None:
                rope_parameters[hf_key] = _float32_decimal(value)
    return {
        "architectures": [SUPPORTED_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
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
    heads_of = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    if config["model_type"] not in _PERMUTED_QK_ARCHITECTURES:
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
        name = hf_name(tensor.name)
        # GGUF lists dimensions innermost first.
        shape = tuple(int(n) for n in reversed(tensor.shape))
        # A plain ndarray view: slicing np.memmap objects inside dequantize is twice as slow.
        raw = np.asarray(tensor.data)
        fmt = GGUF_FORMATS.get(int(tensor.tensor_type))
        weight: Weight
        if fmt is not None and int(tensor.tensor_type) in keep_types and len(shape) == 2:
            weight = _quantized(raw, fmt, shape)
        else:
            if tensor.tensor_type not in _FLOAT_TYPES:
                type_name = tensor.tensor_type.name
                dequantized_types[type_name] = dequantized_types.get(type_name, 0) + 1
            weight = _tensor_to_torch(dequantize(raw, tensor.tensor_type), shape, dtype)
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
    _write_json(out_dir / TOKENIZER_CONFIG_FILE, tokenizer_config(metadata, context_length))
    build_tokenizer(metadata, gguf_path).save(str(out_dir / TOKENIZER_FILE))


def convert_gguf_to_hf_dir(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype) -> None:
    start = time.perf_counter()
    write_hf_dir(read_gguf(gguf_path, dtype), Path(out_dir))
    log.info(
        "converted %s to %s in %.2f s", Path(gguf_path).name, out_dir, time.perf_counter() - start
    )
