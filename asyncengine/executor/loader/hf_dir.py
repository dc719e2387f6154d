"""Read a Hugging Face model directory: config.json, generation_config.json, safetensors."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from asyncengine.executor.loader.progress import format_bytes, log, progress

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


class ModelFilesError(ValueError):
    """A model directory lacks a file it needs, or one of its files is inconsistent."""


def read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ModelFilesError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The model's config.json as a dict (ModelConfig.from_hf_dict parses it)."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise ModelFilesError(
            f"{model_dir} is not a Hugging Face model directory: no {CONFIG_FILE}"
        )
    return read_json(path)


def load_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """generation_config.json as a dict, or {} when the directory has none."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    return read_json(path) if path.is_file() else {}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise ModelFilesError(f"eos_token_id must be an integer or a list of integers, got {value!r}")


def load_eos_token_ids(model_dir: str | Path) -> list[int]:
    """End-of-sequence ids: generation_config.json's first (chat models list their turn end there),
    then config.json's, without duplicates (a tokenizer-only directory may lack config.json)."""
    generation = load_generation_config(model_dir).get("eos_token_id")
    config_path = Path(model_dir) / CONFIG_FILE
    config = read_json(config_path).get("eos_token_id") if config_path.is_file() else None
    ids: list[int] = []
    for token_id in _as_id_list(generation) + _as_id_list(config):
        if token_id not in ids:
            ids.append(token_id)
    return ids


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files: the shards an index names, model.safetensors, or every *.safetensors."""
    model_dir = Path(model_dir)
    index_path = model_dir / WEIGHTS_INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFilesError(f"{index_path}: no weight_map")
        shards = list(dict.fromkeys(weight_map.values()))
        missing = [name for name in shards if not (model_dir / name).is_file()]
        if missing:
            raise ModelFilesError(
                f"{model_dir}: shards named in {WEIGHTS_INDEX_FILE} are missing: {missing}"
            )
        return [model_dir / name for name in shards]
    if (model_dir / SINGLE_WEIGHTS_FILE).is_file():
        return [model_dir / SINGLE_WEIGHTS_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFilesError(f"{model_dir}: no safetensors weights (only safetensors are read)")
    return files


def load_weights(model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint on CPU under its HF name; floating point ones cast to dtype.

    A tied checkpoint has no lm_head.weight: the model ties it to model.embed_tokens.weight.
    """
    model_dir = Path(model_dir)
    files = safetensors_files(model_dir)
    start = time.perf_counter()
    weights: dict[str, torch.Tensor] = {}
    total_bytes = 0
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = list(f.keys())
        for name in progress(names, f"loading {path.name}", total=len(names)):
            # one map of the file per tensor: a map keeps every page read resident until it
            # closes, so one map for the whole file held its bytes beside their copies (the
            # peak twice the weights); each copy is made before its map closes
            with safe_open(str(path), framework="pt", device="cpu") as f:
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                else:
                    tensor = tensor.clone()  # not a view of the map
            if name in weights:
                raise ModelFilesError(f"{model_dir}: tensor {name} appears in two files")
            weights[name] = tensor
            total_bytes += tensor.numel() * tensor.element_size()
    index_path = model_dir / WEIGHTS_INDEX_FILE
    if index_path.is_file():
        expected = set(read_json(index_path)["weight_map"])
        if missing := sorted(expected - weights.keys()):
            raise ModelFilesError(
                f"{model_dir}: tensors in the index but in no shard: {missing[:5]}"
            )
    log.info(
        "loaded %d tensors (%s as %s) from %d file(s) in %s in %.2f s",
        len(weights),
        format_bytes(total_bytes),
        str(dtype).removeprefix("torch."),
        len(files),
        model_dir,
        time.perf_counter() - start,
    )
    return weights
