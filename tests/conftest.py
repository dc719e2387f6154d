"""Shared fixtures: tiny random Hugging Face checkpoints saved once per test session."""

from __future__ import annotations

import logging
import os

# Triton kernel tests run on CPU through the interpreter; it must be chosen before triton loads.
os.environ["TRITON_INTERPRET"] = "1"

import glob
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch


@dataclass(frozen=True, slots=True)
class TinyCheckpoint:
    """A saved HF checkpoint directory (config.json + model.safetensors)."""

    name: str
    path: Path

    @property
    def hf_config(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def load_weights(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.path / "model.safetensors"))

    def load_hf_model(self, dtype: torch.dtype = torch.float32) -> Any:
        """The HF model (loaded once per session and dtype; do not modify it)."""
        key = (self.path, dtype)
        if key not in _HF_MODELS:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype)
            _HF_MODELS[key] = model.eval()
        return _HF_MODELS[key]


_HF_MODELS: dict[tuple[Path, torch.dtype], Any] = {}


# Small but not degenerate: GQA (4 q heads over 2 kv heads), several layers, a larger init so
# that attention is far from uniform and a wrong key or position changes the logits.
_COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.25,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Llama 3.2's RoPE scaling as its config.json has it (base 500000 beside it)
LLAMA32_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_gqa": ("llama", {"tie_word_embeddings": False, "rope_theta": 10000.0}),
    "llama_tied": (
        "llama",
        {"tie_word_embeddings": True, "num_key_value_heads": 4, "rope_theta": 500.0},
    ),
    "qwen2_bias": ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1000.0}),
    "llama3_rope": (
        "llama",
        {
            "tie_word_embeddings": False,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    # Qwen2.5's YaRN form, trained on 16 positions: the prompts run past them
    "qwen2_yarn": (
        "qwen2",
        {
            "tie_word_embeddings": True,
            "rope_theta": 1000.0,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        },
    ),
    # q/k RMSNorm per head, no attention bias, head_dim apart from hidden/heads
    "qwen3_qk_norm": ("qwen3", {"tie_word_embeddings": False, "head_dim": 24}),
    # (1 + w) norms, GeGLU (tanh), embeddings times sqrt(hidden), tied, head_dim 32 (not 16)
    "gemma": ("gemma", {"head_dim": 32, "hidden_act": "gelu_pytorch_tanh"}),
    # four norms a layer, query_pre_attn_scalar, attention soft-cap small enough to bite, a
    # final-logit soft-cap, and a window of 8 keys on layers 0 and 2 (head_dim 64: the native
    # extend kernel runs it)
    "gemma2": (
        "gemma2",
        {
            "head_dim": 64,
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    # per-head (1 + w) q/k norms, no soft-caps, sliding layers on their own RoPE base, the full
    # layers on a linear-scaled one
    "gemma3": (
        "gemma3",
        {
            "head_dim": 64,
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] + ["sliding_attention"] * 2,
            "query_pre_attn_scalar": 48,
            "rope_theta": 5000.0,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
    ),
    # Mistral-7B-v0.1's form: a window (8 keys) on every layer, untied
    "mistral_window": ("mistral", {"tie_word_embeddings": False, "sliding_window": 8}),
    # Qwen2 with use_sliding_window: a window of 8 on the layers from max_window_layers (1) on
    "qwen2_window": (
        "qwen2",
        {
            "tie_word_embeddings": True,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        },
    ),
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def make_tiny_checkpoint(name: str, directory: Path) -> TinyCheckpoint:
    from transformers import (
        AutoModelForCausalLM,
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    kind, overrides = TINY_CONFIGS[name]
    config_cls = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "gemma": GemmaConfig,
        "gemma2": Gemma2Config,
        "gemma3": Gemma3TextConfig,
    }[kind]
    config = config_cls(**{**_COMMON, **overrides})
    config.architectures = [ARCHITECTURES[kind]]
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases too, so that a dropped bias shows in the logits
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return TinyCheckpoint(name, directory)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyCheckpoint]:
    """Every tiny checkpoint by name (TINY_CONFIGS)."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {name: make_tiny_checkpoint(name, root / name) for name in TINY_CONFIGS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints: dict[str, TinyCheckpoint]) -> TinyCheckpoint:
    """Llama with GQA and untied embeddings."""
    return tiny_checkpoints["llama_gqa"]


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_checkpoints: dict[str, TinyCheckpoint]) -> TinyCheckpoint:
    """Qwen2 with q/k/v biases and tied embeddings."""
    return tiny_checkpoints["qwen2_bias"]


@pytest.fixture(scope="session", autouse=True)
def forget_temporary_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The engine caches a GGUF's metadata (and a float GGUF's conversion) under a name made from
    the file's path, size and time; the suite's GGUFs live in temporary directories, so their
    cache entries go with them at the end instead of piling up in the user's cache."""
    yield
    from asyncengine.common.private_cache import cache_root
    from asyncengine.executor.loader.default_model import gguf_file

    root = cache_root()
    for path in tmp_path_factory.getbasetemp().rglob("*.gguf"):
        found = gguf_file(path)
        if found is None:
            continue
        for entry in root.glob(f"{glob.escape(found[1])}-*"):
            shutil.rmtree(entry, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> str:
    """Whether the compiled core (mypyc, asyncengine/compiled.py) runs, or the ``.py`` files:
    all of them while one was edited since the build (named, until make setup builds it)."""
    from asyncengine.compiled import core_kind, edited_since_build

    edited = edited_since_build()
    return f"asyncengine core: {core_kind()}" + (
        f" (edited since the build: {', '.join(edited)})" if edited else ""
    )


# Tests that start a local Ray cluster: one cluster at a time under pytest-xdist
RAY_TEST_FILES = frozenset(
    {
        "tests/server/test_ray_cli.py",
        "tests/server/test_ray_replicas.py",
        "tests/sim/test_policy_sweeps.py",
    }
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How ``make test`` spreads the suite over its pytest-xdist workers (``-n 2``): a file's
    tests run on one worker, so its module-scoped fixtures (servers, models) are made once and a
    test that checks what earlier tests of its file left behind (the counters of a shared
    server) sees them; the Ray files share one worker. (Like ``--dist loadfile`` with one
    group more; xdist's own ``xdist_group`` marks do not take under pytest 9.2.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::")[0]
            return "ray" if file in RAY_TEST_FILES else file

    return FileScheduling(config, log)


@pytest.fixture
def without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 product's paths on a CPU with AMX too, where the K formats take the AMX product
    instead (executor/layers/linear.py, ``AMX_FORMATS``)."""
    from asyncengine.kernels.cpu import quant_amx_native

    monkeypatch.setattr(quant_amx_native, "available", lambda: False)


@pytest.fixture(params=[1, 2, 3], ids=["1-thread", "2-threads", "3-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's thread count for the test: a native kernel's work split over 1, 2 and 3 threads
    (a module overrides it where other counts matter)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def quiet_scheduler(caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler's warnings (an overloaded run's retractions) off for one test, restored
    after it: a level left set would hide them from a later test's ``caplog``."""
    caplog.set_level(logging.ERROR, logger="asyncengine.scheduler.scheduler")


@pytest.fixture(autouse=True)
def _scheduler_log_level() -> Iterator[None]:
    """Whatever a test's code sets the scheduler logger's level to (a script's ``main`` run in
    process quiets it) ends with the test, so a later test's ``caplog`` sees its warnings."""
    logger = logging.getLogger("asyncengine.scheduler.scheduler")
    level = logger.level
    yield
    logger.setLevel(level)
