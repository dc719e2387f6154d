"""Model loading: HF directories, GGUF files and the embedded default model.

Typical use::

    model_dir = resolve_model(config.model, dtype)       # name, HF directory or .gguf file
    hf_config = load_hf_config(model_dir)                 # -> ModelConfig.from_hf_dict
    weights = load_weights(model_dir, dtype)              # HF names -> CPU tensors in dtype
    eos_ids = load_eos_token_ids(model_dir)
"""

from __future__ import annotations

from asyncengine.common.private_cache import CACHE_ENV, UnsafeCacheError, cache_root
from asyncengine.executor.loader.default_model import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    UnknownModelError,
    resolve_model,
    tokenizer_dir,
)
from asyncengine.executor.loader.gguf_loader import (
    GGUFCheckpoint,
    convert_gguf_to_hf_dir,
    read_gguf,
    write_tokenizer_dir,
)
from asyncengine.executor.loader.hf_dir import (
    ModelFilesError,
    load_eos_token_ids,
    load_generation_config,
    load_hf_config,
    load_weights,
    safetensors_files,
)

__all__ = [
    "CACHE_ENV",
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "GGUFCheckpoint",
    "ModelFilesError",
    "UnknownModelError",
    "UnsafeCacheError",
    "cache_root",
    "convert_gguf_to_hf_dir",
    "load_eos_token_ids",
    "load_generation_config",
    "load_hf_config",
    "load_weights",
    "read_gguf",
    "resolve_model",
    "safetensors_files",
    "tokenizer_dir",
    "write_tokenizer_dir",
]
