"""The host tier on the real engine (float32, greedy): multi-turn conversations through a pool
far smaller than their working set give the same tokens as HF with the tier on, under every
eviction rule, with pages copied back from host memory instead of computed again."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.policies.eviction_registry import EVICTION_RULES
from tests.api.test_engine_parity import VOCAB, hf_greedy, tiny_chat_model  # noqa: F401

TURNS, CONVERSATIONS, ANSWER = 3, 4, 6


def conversations(seed: int) -> list[list[list[int]]]:
    """Turn k's user messages of each conversation (system prompt shared)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(24)]
    return [
        [system + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(20, 40))]]
        + [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 12))] for _ in range(TURNS - 1)]
        for _ in range(CONVERSATIONS)
    ]


async def chat(generate, seed: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Round-robin turns: each prompt is the conversation so far and its new message."""
    histories: list[list[int]] = [[] for _ in range(CONVERSATIONS)]
    outputs: list[list[int]] = []
    for turn in range(TURNS):
        for index, messages in enumerate(conversations(seed)):
            prompt = histories[index] + messages[turn]
            answer = await generate(prompt)
            outputs.append(answer)
            histories[index] = prompt + answer
    return outputs


@pytest.fixture(scope="module")
def expected(hf_greedy) -> list[list[int]]:  # type: ignore[no-untyped-def]
    async def generate(prompt: list[int]) -> list[int]:
        return hf_greedy(prompt, ANSWER)

    return asyncio.run(chat(generate, seed=5))


def tier_config(model: Path, **config: object) -> EngineConfig:
    """The tiny float32 model with a 128-token pool, a host buffer beside it, ``config`` on top."""
    return EngineConfig(
        model=str(model),
        dtype="float32",
        page_size=4,
        kv_cache_tokens=128,  # the conversations hold ~4x more
        swap_space_bytes=1 << 20,
        log_interval=0,
        **config,  # type: ignore[arg-type]
    )


async def run_engine(model: Path, **config: object) -> tuple[list[list[int]], dict]:
    engine = AsyncEngine(tier_config(model, **config))
    params = SamplingParams(max_new_tokens=ANSWER, temperature=0, ignore_eos=True)
    async with engine:
        engine.step_hooks.append(lambda plan: engine.scheduler.kv.check_invariant())

        async def generate(prompt: list[int]) -> list[int]:
            return (await engine.generate(prompt, params)).token_ids

        outputs = await chat(generate, seed=5)
        stats = engine.stats()
    return outputs, stats


@pytest.mark.parametrize("rule", sorted(EVICTION_RULES))
def test_the_host_tier_gives_the_same_tokens_under_every_rule(
    tiny_chat_model: Path,
    expected: list[list[int]],
    rule: str,
) -> None:
    got, stats = asyncio.run(run_engine(tiny_chat_model, host_kv_tier=True, eviction_policy=rule))
    assert got == expected
    assert stats["host_hit_tokens"] > 0 and stats["tier_in_bytes"] > 0
    assert stats["evictions"] > 0


def test_without_the_tier_the_same_tokens_cost_recomputation(
    tiny_chat_model: Path,
    expected: list[list[int]],
) -> None:
    got, with_tier = asyncio.run(run_engine(tiny_chat_model, host_kv_tier=True))
    plain, without = asyncio.run(run_engine(tiny_chat_model))
    assert got == plain == expected
    assert with_tier["hit_tokens"] > without["hit_tokens"]
    assert with_tier["miss_tokens"] < without["miss_tokens"]
