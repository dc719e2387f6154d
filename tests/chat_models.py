"""A tiny random Qwen3 with a Qwen3-style chat template (tools, <tool_call>, <think>,
enable_thinking) and Qwen's tool and think markers as single added tokens, like the real
Qwen3 tokenizer has them; the rest of the tokenizer is the default model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.server_support import TOKENIZER_FILES

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
QWEN3_MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

TINY_QWEN3: dict[str, Any] = {
    "vocab_size": 49160,  # the default tokenizer's 49152 and the markers
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 checkpoint, written once per test session."""
    target = tmp_path_factory.getbasetemp() / "tiny_qwen3_chat"
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoModelForCausalLM, Qwen3Config

    from asyncengine.executor.loader import DEFAULT_MODEL, resolve_model

    default_dir = resolve_model(DEFAULT_MODEL, torch.bfloat16)
    staging = tmp_path_factory.mktemp("tiny_qwen3_staging")
    config = Qwen3Config(**TINY_QWEN3)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(4321)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        staging, safe_serialization=True
    )
    for name in TOKENIZER_FILES:
        if (default_dir / name).is_file():
            shutil.copy(default_dir / name, staging / name)
    tokenizer = Tokenizer.from_file(str(staging / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(marker, special=False) for marker in QWEN3_MARKERS])
    tokenizer.save(str(staging / "tokenizer.json"))
    tokenizer_config = json.loads((staging / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    shutil.copy(TEMPLATES / "qwen3_style.jinja", staging / "chat_template.jinja")
    staging.rename(target)
    return target


def tiny_thinking_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 with a template whose generation prompt opens the think block (as
    DeepSeek-R1's and later Qwen3's do), so that its output is reasoning until ``</think>``;
    ``enable_thinking`` false closes the block in the prompt instead."""
    target = tmp_path_factory.getbasetemp() / "tiny_thinking_qwen3_chat"
    if (target / "chat_template.jinja").is_file():
        return target
    source = tiny_qwen3_dir(tmp_path_factory)
    staging = tmp_path_factory.mktemp("tiny_thinking_qwen3_staging")
    for path in source.iterdir():
        if path.name != "chat_template.jinja":
            (staging / path.name).symlink_to(path)
    template = (source / "chat_template.jinja").read_text()
    closed = "{{- '<think>\\n\\n</think>\\n\\n' }}"
    assert closed in template
    opened = closed + "\n    {%- else %}\n        {{- '<think>\\n' }}"
    (staging / "chat_template.jinja").write_text(template.replace(closed, opened))
    staging.rename(target)
    return target
