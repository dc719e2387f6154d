"""Qwen3, Mistral and Gemma 1/2/3 through the whole engine against HF transformers: greedy tokens
and the logprobs of every generated token (the engine's raw logits) match, with prompts chunked
over several steps and sharing cached prefixes. Mistral with a window of 8 keys on every layer,
Gemma 2/3 on their sliding layers, so that windows matter at these lengths (prompts up to ~60
tokens); Mistral also with a cached prefix six times its window."""

from __future__ import annotations

import asyncio
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.executor.loader import resolve_model

VOCAB = 49152  # the default model's tokenizer, so the engine has one

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 24, "tie_word_embeddings": False}),
    "mistral": ("MistralForCausalLM", {"sliding_window": 8, "tie_word_embeddings": False}),
    "gemma": ("GemmaForCausalLM", {"head_dim": 32, "hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "head_dim": 64,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "head_dim": 64,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 48,
            "rope_theta": 5000.0,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
    ),
}


def _make(family: str, directory: Path) -> Path:
    from transformers import (
        AutoModelForCausalLM,
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        MistralConfig,
        Qwen3Config,
    )

    architecture, extra = FAMILIES[family]
    config_cls = {
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "gemma": GemmaConfig,
        "gemma2": Gemma2Config,
        "gemma3": Gemma3TextConfig,
    }[family]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    config.architectures = [architecture]
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from their init, so a wrong norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    source = resolve_model("smollm2-135m", torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, directory / name)
    return directory


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(request.param, tmp_path_factory.mktemp(request.param))


def _items() -> list[tuple[list[int], int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, VOCAB) for _ in range(30)]
    items = []
    for i in range(6):
        head = shared[: rng.randrange(12, 30)] if i % 3 else []
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))]
        items.append((head + tail, rng.randrange(8, 20)))
    return items


async def _run_engine(model: Path, items: list[tuple[list[int], int]]) -> tuple[list[Any], dict]:
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        page_size=4,
        kv_cache_tokens=1024,
        chunked_prefill_size=8,
        max_prefill_tokens=16,
        log_interval=0,
    )
    async with AsyncEngine(config) as engine:
        engine.step_hooks.append(lambda plan: engine.scheduler.kv.check_invariant())
        params = [
            SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=True)
            for _, n in items
        ]
        # the first request caches the shared prefix the later ones hit
        first = await engine.generate(items[0][0], params[0])
        rest = await asyncio.gather(
            *(engine.generate(p, sp) for (p, _), sp in zip(items[1:], params[1:], strict=True))
        )
        stats = engine.stats()
    return [first, *rest], stats


@pytest.mark.slow
def test_greedy_tokens_and_logprobs_match_hf(family_model: Path) -> None:
    items = _items()
    outputs, stats = asyncio.run(_run_engine(family_model, items))
    assert stats["hit_tokens"] > 0, "later prompts were meant to hit the cached shared prefix"
    _assert_hf_answers(family_model, items, outputs)


@pytest.mark.slow
def test_a_mistral_prefix_hit_far_past_its_window_answers_as_hf(tmp_path: Path) -> None:
    """An 80-token prompt, then one sharing its first 48 tokens (six windows of 8): the second
    takes the cached prefix, whose keys outside its queries' windows stay in the pool unread,
    and both answer HF's greedy tokens and logprobs over 24 decode steps."""
    model = _make("mistral", tmp_path)
    rng = random.Random(11)
    first = [rng.randrange(3, VOCAB) for _ in range(80)]
    items = [(first, 24), (first[:48] + [rng.randrange(3, VOCAB) for _ in range(20)], 24)]
    outputs, stats = asyncio.run(_run_engine(model, items))
    assert stats["hit_tokens"] >= 48 - 4  # the shared prefix's whole pages (page_size 4)
    _assert_hf_answers(model, items, outputs)


def _assert_hf_answers(model: Path, items: list[tuple[list[int], int]], outputs: list[Any]) -> None:
    """Each output's tokens are HF's greedy ones and its logprobs HF's for those tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for (prompt, n), out in zip(items, outputs, strict=True):
        with torch.inference_mode():
            want = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            full = torch.tensor([prompt + out.token_ids])
            logprobs = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        assert out.token_ids == want
        expected = [
            logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(out.token_ids)
        ]
        got = [lp.token_logprob for lp in out.logprobs or []]
        assert got == pytest.approx(expected, abs=1e-4)
