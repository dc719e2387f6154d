"""Which weights stay quantized: the ``quantization`` config key applied to a model at load.

    loaded = load_model(config.model, dtype, device, config.quantization)
    loaded.model_dir      # config.json + tokenizer (for a GGUF kept quantized: no weights in it)
    loaded.weights        # HF names -> dense tensors, or QuantizedTensor (kernels/quant_formats)

- ``auto``: a GGUF's tensors in a format the CPU kernels take stay as stored (the file's bytes,
  q/k rows unpermuted as blocks); other types are dequantized to dtype (one log line). On CUDA,
  or where the native library cannot be built, everything is dequantized (as ``none``). Other
  checkpoints load as they are.
- ``none``: every weight expanded to dtype (the converted HF directory in the cache).
- ``int8``: a float checkpoint's 2-D weights (projections, embedding, LM head) quantized per
  output row, symmetric (I8); CPU only, a config error elsewhere.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncengine.common.config import ConfigError
from asyncengine.executor.loader.default_model import gguf_file, metadata_dir, resolve_model
from asyncengine.executor.loader.gguf_file import read_gguf_file
from asyncengine.executor.loader.gguf_loader import Weight, read_gguf_weights
from asyncengine.executor.loader.hf_dir import load_weights
from asyncengine.kernels.cpu import quant_native
from asyncengine.kernels.quant_formats import GGUF_FORMATS, I8, QuantizedTensor
from asyncengine.kernels.reference.quant_ref import quantize_i8

log = logging.getLogger("asyncengine.loader")

_INT8_SUFFIXES = ("_proj.weight", "lm_head.weight", "embed_tokens.weight")
_FLOAT_GGUF_TYPES = frozenset({"F32", "F16", "BF16", "F64"})  # GGUF tensors held as floats


@dataclass(slots=True)
class LoadedModel:
    model_dir: Path
    weights: dict[str, Weight]

    def summary(self) -> str:
        """e.g. "Q4_1 x210, Q8_0 x1 kept quantized" or "dense"."""
        formats = Counter(
            w.format.name for w in self.weights.values() if isinstance(w, QuantizedTensor)
        )
        if not formats:
            return "dense"
        return (
            ", ".join(f"{name} x{count}" for name, count in sorted(formats.items())) + " quantized"
        )


def native_kernels(device: torch.device) -> bool:
    return device.type == "cpu" and quant_native.available()


def load_model(
    model: str, dtype: torch.dtype, device: torch.device, quantization: str
) -> LoadedModel:
    if quantization == "int8":
        if not native_kernels(device):
            raise ConfigError(
                f"config key 'quantization' = 'int8': no int8 kernel on {device.type} "
                "(the CPU's needs a C compiler); use 'none'"
            )
        warn_requantized(model, dtype)
        model_dir = resolve_model(model, dtype)
        return LoadedModel(model_dir, quantize_int8(dict(load_weights(model_dir, dtype))))
    found = gguf_file(model)
    if quantization == "auto" and found is not None and native_kernels(device):
        gguf_path, cache_name = found
        _, weights = read_gguf_weights(gguf_path, dtype, keep_types=frozenset(GGUF_FORMATS))
        return LoadedModel(metadata_dir(gguf_path, cache_name), weights)
    model_dir = resolve_model(model, dtype)
    return LoadedModel(model_dir, dict(load_weights(model_dir, dtype)))


def warn_requantized(model: str, dtype: torch.dtype) -> None:
    """Say so when ``int8`` is asked of a GGUF whose weights are quantized already: they are
    expanded and rounded again, larger and coarser than the blocks ``auto`` would keep."""
    found = gguf_file(model)
    if found is None:
        return
    blocks = sorted(
        {t.tensor_type.name for t in read_gguf_file(found[0]).tensors} - _FLOAT_GGUF_TYPES
    )
    if blocks:
        log.warning(
            "quantization 'int8': the %s weights of %s are expanded to %s and rounded again to "
            "int8 rows, more bytes and more error than the blocks 'auto' keeps as stored",
            ", ".join(blocks),
            found[0].name,
            str(dtype).removeprefix("torch."),
        )


def quantize_int8(weights: dict[str, Weight]) -> dict[str, Weight]:
    """The 2-D projection / embedding / LM head weights as I8 (rows of whole 32-value blocks)."""
    out: dict[str, Weight] = {}
    for name, weight in weights.items():
        if (
            isinstance(weight, torch.Tensor)
            and weight.dim() == 2
            and weight.shape[1] % I8.block_size == 0
            and name.endswith(_INT8_SUFFIXES)
        ):
            out[name] = quantize_i8(weight)
        else:
            out[name] = weight
    return out
