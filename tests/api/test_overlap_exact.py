"""The engine with overlap scheduling (the next plan made while the forward runs, its decode
inputs filled in by the executor) against the engine without: the real model on the CPU in
deterministic mode, greedy, token for token and text for text, with stop strings, stop token
ids and max_tokens ending requests one step before the plan in flight lands. Nothing past an
ending reaches a stream."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from tests.api.test_engine_parity import VOCAB, tiny_chat_model  # noqa: F401 (fixture)

Result = tuple[list[int], str, str | None]  # streamed token ids, streamed text, reason


async def run(
    model: Path,
    overlap: bool,
    items: list[tuple[list[int], SamplingParams]],
    **config: object,
) -> tuple[list[Result], int, int]:
    """Each request's streamed token ids and text and its finish reason, how many plans were
    made ahead, and how many requests were retracted."""
    engine = AsyncEngine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            deterministic=True,
            enable_overlap_schedule=overlap,
            page_size=4,
            log_interval=0,
            **{"kv_cache_tokens": 4096, "chunked_prefill_size": 16, **config},  # type: ignore[arg-type]
        )
    )
    deferred: list[int] = []
    async with engine:
        assert engine.core is not None
        # the CPU executor keeps the lock-step path unless told: here the overlapped one
        engine.core.executor.defers_inputs = overlap  # type: ignore[attr-defined]
        engine.step_hooks.append(lambda plan: deferred.append(len(plan.deferred)))
        engine.step_hooks.append(lambda plan: engine.scheduler.kv.check_invariant())

        async def one(prompt: list[int], params: SamplingParams) -> Result:
            streamed: list[int] = []
            text = ""
            final = None
            async for delta in engine.stream(prompt, params):
                streamed.extend(delta.token_ids)
                text += delta.text
                final = delta
            assert final is not None and final.finished
            return streamed, text, final.finish_reason

        results = await asyncio.gather(*(one(p, s) for p, s in items))
        assert engine.scheduler.kv.stats()["pages_used"] == 0
        retractions = engine.stats()["retractions"]
    return list(results), sum(1 for n in deferred if n), retractions


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(24)]
    return [
        (shared[: rng.randrange(4, 24)] if i % 3 == 0 else [])
        + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 30))]
        for i in range(n)
    ]


def greedy(n: int, **extra: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **extra)  # type: ignore[arg-type]


def test_overlapped_engine_is_token_exact_with_stops(tiny_chat_model: Path) -> None:
    rng = random.Random(3)
    plain_items = [(p, greedy(rng.randrange(6, 24))) for p in prompts(5, 12)]
    plain, _, _ = asyncio.run(run(tiny_chat_model, False, plain_items))
    # endings taken from the plain outputs: a stop string from the middle of a request's text,
    # a stop token it samples, or its length alone
    items = []
    for i, ((prompt, params), (ids, text, _)) in enumerate(zip(plain_items, plain, strict=True)):
        n = params.max_new_tokens
        middle = text[len(text) // 2 : len(text) // 2 + 2]
        if i % 3 == 0 and middle.strip():
            items.append((prompt, greedy(n, stop=[middle])))
        elif i % 3 == 1:
            items.append((prompt, greedy(n, stop_token_ids=[ids[len(ids) // 2]])))
        else:
            items.append((prompt, params))
    lock_step, none_ahead, _ = asyncio.run(run(tiny_chat_model, False, items))
    overlapped, ahead, _ = asyncio.run(run(tiny_chat_model, True, items))
    assert none_ahead == 0
    assert ahead > 5, "the overlapped engine was meant to plan decode steps ahead"
    assert overlapped == lock_step
    reasons = [r[2] for r in lock_step]
    assert reasons.count("stop") >= 4 and "length" in reasons
    for (ids, text, reason), (_, params) in zip(lock_step, items, strict=True):
        if params.stop:
            assert reason == "stop" and not any(s in text for s in params.stop)
        if params.stop_token_ids:
            assert reason == "stop" and ids[-1] in params.stop_token_ids
            assert all(t not in params.stop_token_ids for t in ids[:-1])
        assert len(ids) <= params.max_new_tokens


def test_overlapped_engine_is_token_exact_when_kv_runs_short(tiny_chat_model: Path) -> None:
    """A pool too small for every request at once: steps that would retract are planned after
    the landing, the others ahead; the tokens are the lock-step engine's."""
    rng = random.Random(4)
    items = [(p, greedy(rng.randrange(12, 30))) for p in prompts(9, 10)]
    # as tests/api/test_engine_parity.py forces retractions: a small pool, admission that
    # reserves little room for the running requests' future tokens
    short = {
        "kv_cache_tokens": 160,
        "chunked_prefill_size": 8,
        "max_prefill_tokens": 16,
        "init_new_token_ratio": 0.05,
        "min_new_token_ratio": 0.01,
    }
    lock_step, _, _ = asyncio.run(run(tiny_chat_model, False, items, **short))
    overlapped, ahead, retractions = asyncio.run(run(tiny_chat_model, True, items, **short))
    assert retractions > 0, "the pool was meant to be small enough to force retractions"
    assert ahead > 5
    assert overlapped == lock_step
