"""Closed-loop chat on the real engine (tiny float32 model, greedy): each turn's prompt is the
previous turn's prompt and the engine's own answer and the next message; the host tier gets the
evicted histories back as hits and changes no answer."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from asyncengine.bench.optimal_hit import optimal_hit
from asyncengine.bench.records import summarize
from asyncengine.sim.closed_loop import (
    ClosedLoopRun,
    conversations_of,
    outputs_agree,
    replay_closed_loop,
)
from asyncengine.workloads.generators import multi_turn
from tests.api.test_engine_parity import VOCAB, tiny_chat_model  # noqa: F401
from tests.api.test_host_tier_parity import tier_config

CONVERSATIONS, TURNS = 6, 3


def chats() -> list:  # type: ignore[type-arg]
    return multi_turn(
        CONVERSATIONS,
        TURNS,
        vocab_size=VOCAB,
        system_len=16,
        user_median=16.0,
        max_user_len=24,
        output_len=6,
        seed=3,
    )


def test_conversations_are_read_back_out_of_a_multi_turn_workload() -> None:
    workload = chats()
    conversations = conversations_of(workload)
    assert len(conversations) == CONVERSATIONS
    for index, conversation in enumerate(conversations):
        # multi_turn orders turn by turn: request i is turn i // CONVERSATIONS of chat i % ...
        assert [t.rid for t in conversation.turns] == [
            workload[turn * CONVERSATIONS + index].rid for turn in range(TURNS)
        ]
        assert conversation.messages[0] == conversation.turns[0].prompt_ids
        for before, turn, message in zip(
            conversation.turns, conversation.turns[1:], conversation.messages[1:], strict=False
        ):
            head = len(before.prompt_ids)
            assert turn.prompt_ids[:head] == before.prompt_ids
            assert turn.prompt_ids[head + before.output_len :] == message and message
    assert sum(c.final_context for c in conversations) == sum(
        len(w.prompt_ids) + w.output_len for w in workload[-CONVERSATIONS:]
    )


def run(model: Path, concurrency: int, **config: object) -> ClosedLoopRun:
    engine_config = tier_config(model, **config)
    return asyncio.run(replay_closed_loop(engine_config, conversations_of(chats()), concurrency))


@pytest.mark.parametrize("concurrency", [1, 3])
def test_each_turn_sends_back_the_engines_answer_and_the_tier_keeps_it(
    tiny_chat_model: Path,
    concurrency: int,
) -> None:
    tiered = run(tiny_chat_model, concurrency, host_kv_tier=True)
    plain = run(tiny_chat_model, concurrency)
    conversations = conversations_of(chats())
    assert sum(c.final_context for c in conversations) >= 3 * 128
    for conversation in conversations:
        previous: list[int] | None = None
        for turn, message in zip(conversation.turns, conversation.messages, strict=True):
            prompt = tiered.prompts[turn.rid]
            answer = tiered.outputs[turn.rid]
            assert len(answer) == turn.output_len
            if previous is not None:  # the previous prompt, its answer, then the new message
                assert prompt == previous + message
            previous = prompt + answer
    assert all(r.completed for r in tiered.records) and len(tiered.records) == CONVERSATIONS * TURNS
    assert outputs_agree([plain.outputs, tiered.outputs]).startswith("identical")
    assert tiered.stats["host_hit_tokens"] > 0  # type: ignore[operator]
    assert tiered.stats["hit_tokens"] > plain.stats["hit_tokens"]  # type: ignore[operator]
    for loop in (tiered, plain):
        _, hit, bound = hit_and_bounds(loop)
        assert hit <= bound
    # with one turn in flight the closed loop runs chats round-robin: turn by turn
    if concurrency == 1:
        order = [r.rid for r in tiered.records]
        assert order == sorted(order)


def hit_and_bounds(loop: ClosedLoopRun) -> tuple[float, float, float]:
    """The run's hit rate, the bound over its prompts alone, the bound with its answers."""
    prompts = [loop.prompts[r.rid] for r in loop.records]
    answers = [loop.outputs[r.rid] for r in loop.records]
    hit = summarize(loop.records).cache_hit_rate
    return optimal_hit(prompts).rate, hit, optimal_hit(prompts, 1, answers).rate


@pytest.mark.parametrize("config", [{"kv_cache_tokens": 1024}, {"host_kv_tier": True}])
def test_later_turns_hit_the_answers_within_the_bound(
    tiny_chat_model: Path, config: dict[str, object]
) -> None:
    # long answers, short messages: most of a later turn is the previous answer, which the
    # pool (or the host tier under a small pool) keeps; a bound over prompts alone misses it
    workload = multi_turn(3, 3, vocab_size=VOCAB, system_len=8, user_median=4.0,
                          max_user_len=6, output_len=24, seed=1)  # fmt: skip
    engine_config = tier_config(tiny_chat_model).replace(**config)
    loop = asyncio.run(replay_closed_loop(engine_config, conversations_of(workload), 1))
    prompts_only, hit, bound = hit_and_bounds(loop)
    assert prompts_only < hit <= bound


def test_outputs_agree_names_the_first_answer_that_differs() -> None:
    assert outputs_agree([{"a": [1], "b": [2]}, {"a": [1], "b": [2]}]) == "identical (2 answers)"
    assert outputs_agree([{"a": [1], "b": [2]}, {"a": [1], "b": [3]}]).startswith(
        "DIFFER in 1 of 2 answers (first: b)"
    )


def test_a_turn_with_several_choices_runs_them_and_the_chat_goes_on_from_the_first(
    tiny_chat_model: Path,
) -> None:
    workload = chats()
    first = workload[0]
    workload[0] = replace(first, n=2, cache_salt="s")
    conversations = conversations_of(workload)
    loop = asyncio.run(replay_closed_loop(tier_config(tiny_chat_model), conversations, 2))
    rids = [r.rid for r in loop.records]
    assert f"{first.rid}-0" in rids and f"{first.rid}-1" in rids and first.rid not in rids
    assert all(r.completed for r in loop.records)
    assert len(loop.records) == CONVERSATIONS * TURNS + 1
    chat = next(c for c in conversations if c.turns[0].rid == first.rid)
    answer = loop.outputs[first.rid]
    assert len(answer) == first.output_len
    assert loop.prompts[chat.turns[1].rid] == first.prompt_ids + answer + chat.messages[1]
