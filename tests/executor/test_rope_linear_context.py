"""A llama with linear RoPE scaling serves the stretched context (max_position_embeddings x
factor, as vLLM does): a request past the unscaled length is accepted, and its greedy tokens
are transformers' token for token."""

from __future__ import annotations

import asyncio
import random
import shutil
from pathlib import Path

import pytest
import torch

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.executor.loader import resolve_model

VOCAB = 49152  # the default model's tokenizer, so the engine has one
UNSCALED = 32  # max_position_embeddings
FACTOR = 4


@pytest.fixture(scope="module")
def linear_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = tmp_path_factory.mktemp("linear_llama")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=UNSCALED,
        rope_scaling={"type": "linear", "factor": float(FACTOR)},
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    source = resolve_model("smollm2-135m", torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, directory / name)
    return directory


async def _greedy(model: Path, prompt: list[int], n: int) -> tuple[int, list[int]]:
    config = EngineConfig(
        model=str(model), dtype="float32", page_size=4, kv_cache_tokens=1024, log_interval=0
    )
    async with AsyncEngine(config) as engine:
        params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        out = await engine.generate(prompt, params)
        return engine.max_model_len, out.token_ids


def test_a_request_past_the_unscaled_length_matches_transformers(linear_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    rng = random.Random(3)
    prompt = [rng.randrange(3, VOCAB) for _ in range(2 * UNSCALED)]  # past the unscaled length
    n = UNSCALED  # and further on: 96 of the 128 positions
    max_model_len, tokens = asyncio.run(_greedy(linear_llama, prompt, n))
    assert max_model_len == UNSCALED * FACTOR
    hf = AutoModelForCausalLM.from_pretrained(linear_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert tokens == want
