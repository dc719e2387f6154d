"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers in float32: prompts
crossing prefill-chunk and page boundaries, the prefix cache on and off (a cached prefix never
skips a scored position), n > 1, max_new_tokens 0, and the executor's chunked scoring."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.common.plan import PromptScoring, TokenLogprobs
from asyncengine.common.sampling_params import InvalidRequestError
from asyncengine.executor.prompt_logprobs import logits_and_scores, score_prompt_positions
from tests.hf_scorer import HFScorer, hf, model_dir  # noqa: F401  (fixtures)
from tests.server_support import TINY_MODEL

TOLERANCE = 1e-4
VOCAB = TINY_MODEL["vocab_size"]


def engine_config(model_dir: Path, prefix_cache: bool, score_cache_pages: int = 0) -> EngineConfig:
    # 16-token pages and 40-token chunks: the prompts below cross both several times; the
    # prompt score cache (tested on its own below) off unless asked
    return EngineConfig(
        prompt_score_cache_pages=score_cache_pages,
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        attention_backend="torch",
        kv_cache_tokens=4096,
        max_prefill_tokens=40,
        chunked_prefill_size=40,
        enable_prefix_cache=prefix_cache,
        log_interval=0.0,
    )


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(70)]
    return [
        shared[: rng.randrange(20, 70)] + [rng.randrange(3, VOCAB) for _ in range(n)]
        for n in (1, 30, 57, 90)
    ]


def assert_matches_hf(
    hf: HFScorer, prompt: list[int], got: list[TokenLogprobs | None] | None, k: int, start: int = 0
) -> None:
    assert got is not None and len(got) == len(prompt)
    reference = hf.logprobs(prompt)
    first = max(1, start)
    assert all(entry is None for entry in got[:first])
    for position in range(first, len(prompt)):
        entry = got[position]
        assert entry is not None
        row = reference[position - 1]
        assert abs(entry.token_logprob - float(row[prompt[position]])) < TOLERANCE, position
        best = torch.topk(row, k)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        for (_, value), expected in zip(entry.top, best.values.tolist(), strict=True):
            assert abs(value - expected) < TOLERANCE


async def score_all(
    config: EngineConfig, items: list[list[int]], params: SamplingParams, rounds: int = 1
) -> list[list]:
    results = []
    async with AsyncEngine(config) as engine:
        for _ in range(rounds):
            outs = await asyncio.gather(*(engine.generate(p, params) for p in items))
            results.append(outs)
            engine.core.check_invariant()
    return results


@pytest.mark.parametrize(("prefix_cache", "score_cache"), [(True, 0), (False, 0), (True, 64)])
def test_prompt_logprobs_equal_hf(
    model_dir: Path, hf: HFScorer, prefix_cache: bool, score_cache: int
) -> None:
    items = prompts(0)
    params = SamplingParams(max_new_tokens=3, temperature=0.0, prompt_logprobs=3)
    config = engine_config(model_dir, prefix_cache, score_cache)
    # the second round finds every prompt cached: its scored positions are computed anyway,
    # unless the score cache holds their scores (then they come from it, KV and scores)
    first, second = asyncio.run(score_all(config, items, params, rounds=2))
    for prompt, a, b in zip(items, first, second, strict=True):
        assert_matches_hf(hf, prompt, a.prompt_logprobs, 3)
        assert b.prompt_logprobs == a.prompt_logprobs
        assert b.token_ids == a.token_ids and len(a.token_ids) == 3
        whole_pages = (len(prompt) - 1) // 16 * 16
        if score_cache:  # whole pages, and the tokens after them where a kept tail has them
            assert whole_pages <= b.usage.cached_tokens <= len(prompt) - 1
        else:
            assert b.usage.cached_tokens == 0
        if not score_cache:
            assert a.usage.cached_tokens == 0
    if score_cache:  # the prompts share up to 69 tokens: in the first round already
        assert sum(a.usage.cached_tokens for a in first) > 0


def test_scoring_from_a_start_takes_the_prefix_before_it_from_the_cache(
    model_dir: Path, hf: HFScorer
) -> None:
    prompt = prompts(1)[3]
    params = SamplingParams(
        max_new_tokens=2, temperature=0.0, prompt_logprobs=0, prompt_logprobs_start=41
    )
    first, second = asyncio.run(
        score_all(engine_config(model_dir, True), [prompt], params, rounds=2)
    )
    # logits from position 40 on: the cache may serve the 32 tokens of the pages before it
    assert second[0].usage.cached_tokens == 32
    assert first[0].usage.cached_tokens == 0
    assert_matches_hf(hf, prompt, first[0].prompt_logprobs, 0, start=41)
    assert second[0].prompt_logprobs == first[0].prompt_logprobs


def test_max_new_tokens_zero_scores_the_prompt_and_generates_nothing(
    model_dir: Path, hf: HFScorer
) -> None:
    items = prompts(2)
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=1)
    (outs,) = asyncio.run(score_all(engine_config(model_dir, True), items, params))
    for prompt, out in zip(items, outs, strict=True):
        assert out.token_ids == [] and out.text == ""
        assert out.finish_reason == "length"
        assert out.usage.completion_tokens == 0
        assert_matches_hf(hf, prompt, out.prompt_logprobs, 1)


@pytest.mark.parametrize("max_new_tokens", [0, 4])
def test_every_choice_carries_the_prompt_logprobs(
    model_dir: Path, hf: HFScorer, max_new_tokens: int
) -> None:
    prompt = prompts(3)[2]
    params = SamplingParams(
        max_new_tokens=max_new_tokens, prompt_logprobs=2, n=3, temperature=1.0, seed=7
    )

    async def run() -> list:
        async with AsyncEngine(engine_config(model_dir, True)) as engine:
            outs = await engine.generate_choices(prompt, params)
            engine.core.check_invariant()
            return outs

    outs = asyncio.run(run())
    assert [o.index for o in outs] == [0, 1, 2]
    assert_matches_hf(hf, prompt, outs[0].prompt_logprobs, 2)
    for out in outs:
        assert out.prompt_logprobs == outs[0].prompt_logprobs
        assert len(out.token_ids) == max_new_tokens


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("max_new_tokens", [0, 4])
def test_n_choices_score_the_prompt_once(
    model_dir: Path, prefix_cache: bool, max_new_tokens: int
) -> None:
    """n = 4 computes the prompt's scores once (counted in the plans the core launches) and
    every choice returns them, equal to those of n = 1."""
    prompt = prompts(3)[2]

    async def run(n: int) -> tuple[list, int]:
        params = SamplingParams(
            max_new_tokens=max_new_tokens, prompt_logprobs=2, n=n, temperature=1.0, seed=7
        )
        async with AsyncEngine(engine_config(model_dir, prefix_cache)) as engine:
            scored = 0
            launch = engine.core.launch

            def counting_launch() -> object:
                nonlocal scored
                plan = launch()
                if plan is not None:
                    scored += sum(s.scoring.num_positions for s in plan.scoring_segments)
                return plan

            engine.core.launch = counting_launch  # type: ignore[method-assign]
            outs = await engine.generate_choices(prompt, params)
            engine.core.check_invariant()
            return outs, scored

    (one,), scored_once = asyncio.run(run(1))
    outs, scored = asyncio.run(run(4))
    assert scored_once == len(prompt) - 1
    assert scored == scored_once
    assert len(outs) == 4
    for out in outs:
        # the same scores (within float noise: without the prefix cache the choices' prefills
        # share choice 0's batches, whose shapes differ from n = 1's)
        assert out.prompt_logprobs is not None and one.prompt_logprobs is not None
        for got, want in zip(out.prompt_logprobs, one.prompt_logprobs, strict=True):
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                assert abs(got.token_logprob - want.token_logprob) < TOLERANCE
                assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert out.prompt_logprobs == outs[0].prompt_logprobs
        assert len(out.token_ids) == max_new_tokens


def test_streamed_prompt_logprobs_come_once_in_the_first_delta(model_dir: Path) -> None:
    prompt = prompts(4)[1]

    async def run() -> list:
        async with AsyncEngine(engine_config(model_dir, True)) as engine:
            params = SamplingParams(max_new_tokens=5, temperature=0.0, prompt_logprobs=0)
            return [d async for d in engine.stream(prompt, params)]

    deltas = asyncio.run(run())
    assert deltas[0].prompt_logprobs is not None and len(deltas[0].prompt_logprobs) == len(prompt)
    assert all(d.prompt_logprobs is None for d in deltas[1:])


def test_parameters_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs=1, prompt_logprobs_start=-1)
    assert SamplingParams(max_new_tokens=0, prompt_logprobs=0).max_new_tokens == 0


def test_scoring_in_chunks_equals_scoring_at_once() -> None:
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    hidden = torch.randn(11, 8)
    scorings = [PromptScoring(3, [1, 5, 7, 9], 2), PromptScoring(0, list(range(7)), 0)]
    at_once = score_prompt_positions(hidden, scorings, lambda h: h @ weight.T, chunk_rows=64)
    chunked = score_prompt_positions(hidden, scorings, lambda h: h @ weight.T, chunk_rows=3)
    assert [len(s) for s in chunked] == [len(s) for s in at_once] == [4, 7]
    for got, expected in zip(sum(chunked, []), sum(at_once, []), strict=True):
        assert got.token_logprob == pytest.approx(expected.token_logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in expected.top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in expected.top], abs=1e-5)
    reference = torch.log_softmax(hidden @ weight.T, dim=-1)
    assert at_once[0][1].token_logprob == pytest.approx(float(reference[1, 5]), abs=1e-6)
    assert [t for t, _ in at_once[0][0].top] == torch.topk(reference[0], 2).indices.tolist()
    assert at_once[1][0].top == []


def test_positions_reading_one_row_share_its_logits() -> None:
    """A lead (PromptScoring.lead): two positions read one hidden row, each against its own
    target; the answer equals scoring a copy of the row for each, in chunks or at once."""
    torch.manual_seed(1)
    weight = torch.randn(50, 8)
    hidden = torch.randn(6, 8)
    rows = torch.tensor([0, 1, 2, 1, 3, 4, 5])  # row 1 also leads the second scoring
    scorings = [PromptScoring(0, [4, 9, 11], 2), PromptScoring(1, [7, 8, 2, 3], 1, "a")]
    copies = score_prompt_positions(hidden[rows], scorings, lambda h: h @ weight.T)
    for chunk in (64, 2):
        shared = score_prompt_positions(
            hidden, scorings, lambda h: h @ weight.T, chunk_rows=chunk, rows=rows
        )
        for got, expected in zip(sum(shared, []), sum(copies, []), strict=True):
            assert got.token_logprob == pytest.approx(expected.token_logprob, abs=1e-5)
            assert [t for t, _ in got.top] == [t for t, _ in expected.top]
            assert [v for _, v in got.top] == pytest.approx([v for _, v in expected.top], abs=1e-5)
            assert got.top[0][1] >= got.token_logprob  # the top value and the token's, one row
    reference = torch.log_softmax(hidden @ weight.T, dim=-1)
    assert copies[1][0].token_logprob == pytest.approx(float(reference[1, 7]), abs=1e-6)
    assert copies[0][1].token_logprob == pytest.approx(float(reference[1, 9]), abs=1e-6)
    assert [t for t, _ in copies[1][0].top] == [int(torch.argmax(reference[1]))]


def choices_of_a_question(seed: int) -> list[list[int]]:
    """A 37-token context (two whole pages and 5 tokens) and four continuations."""
    rng = random.Random(seed)
    context = [rng.randrange(3, VOCAB) for _ in range(37)]
    return [context + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 3, 1, 2)]


@pytest.mark.parametrize("together", [False, True])
def test_choices_sharing_a_context_take_its_scores_from_the_score_cache(
    model_dir: Path, hf: HFScorer, together: bool
) -> None:
    """lm-eval's multiple choice: each choice is sent whole. With the score cache the later
    ones take the context's whole pages (KV and scores) from the caches, sent one by one or
    all at once (those then wait a step for the first: in-batch dedup); the scores are those
    of a cold run of each choice on an engine without the score cache, and HF's."""
    items = choices_of_a_question(5)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1)

    async def run(score_cache_pages: int) -> tuple[list, dict]:
        config = engine_config(model_dir, True, score_cache_pages)
        async with AsyncEngine(config) as engine:
            if together:
                outs = await asyncio.gather(*(engine.generate(p, params) for p in items))
            else:
                outs = [await engine.generate(p, params) for p in items]
            engine.core.check_invariant()
            return list(outs), engine.stats()

    cached, stats = asyncio.run(run(64))
    cold = [
        asyncio.run(score_all(engine_config(model_dir, True), [p], params))[0][0] for p in items
    ]
    # the two whole pages from the tree and the score cache; of the 5 context tokens on the
    # third page, 4 from the first choice's kept tail page (the 5th is computed: its logits
    # score the choice's first token); sent together, the third and fourth copy the 5th from
    # the second in the same step, scored from its final hidden state (a lead: step_shares.py)
    shared_5th = 1 if together else 0
    assert [o.usage.cached_tokens for o in cached] == [0, 36, 36 + shared_5th, 36 + shared_5th]
    assert stats["in_step_shared_tokens"] == 2 * shared_5th
    assert stats["prompt_score_hit_positions"] == 3 * 32
    assert stats["tail_hit_tokens"] == 3 * 4
    assert stats["prompt_score_pages_stored"] == 2  # the context's: no choice has a third whole
    assert_equal_to_cold_and_hf(hf, items, cached, cold)


def assert_equal_to_cold_and_hf(
    hf: HFScorer, prompts: list[list[int]], got: list, cold: list
) -> None:
    """Each output's prompt scores match HF's (1e-4) and a cold run's (1e-5, same top ids), and
    its tokens equal the cold run's."""
    for prompt, mine_out, reference in zip(prompts, got, cold, strict=True):
        assert_matches_hf(hf, prompt, mine_out.prompt_logprobs, 1)
        assert mine_out.token_ids == reference.token_ids
        assert mine_out.prompt_logprobs is not None and reference.prompt_logprobs is not None
        for mine, theirs in zip(
            mine_out.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True
        ):
            assert mine is not None and theirs is not None
            assert mine.token_logprob == pytest.approx(theirs.token_logprob, abs=1e-5)
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


@pytest.mark.parametrize("together", [False, True])
def test_choices_after_a_context_shorter_than_a_page_copy_its_kept_tail(
    model_dir: Path, hf: HFScorer, together: bool
) -> None:
    """0-shot multiple choice: the context (6 tokens) is shorter than a page, so neither the
    tree nor the score cache hold it. The first choice's partly filled page is kept when it
    ends; each later choice copies the KV of 5 context tokens from it (copy on write) with
    their scores, and computes the last context token and its continuation. Sent together,
    they run in one forward, the later ones copying those 5 positions' KV from the first's in
    each layer and taking its scores (step_shares.py), and the 6th too: its logits are the
    first's there (a lead). Scores equal a cold run's (1e-5) and HF's (1e-4), and the KV
    invariant holds after every step."""
    rng = random.Random(17)
    context = [rng.randrange(3, VOCAB) for _ in range(6)]
    items = [context + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 3, 2, 1)]
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1)

    async def run() -> tuple[list, dict]:
        async with AsyncEngine(engine_config(model_dir, True, 64)) as engine:
            engine.step_hooks.append(lambda plan: engine.core.check_invariant())
            if together:
                outs = list(await asyncio.gather(*(engine.generate(p, params) for p in items)))
            else:
                outs = [await engine.generate(p, params) for p in items]
            return outs, engine.stats()

    shared, stats = asyncio.run(run())
    cold = [
        asyncio.run(score_all(engine_config(model_dir, False), [p], params))[0][0] for p in items
    ]
    copied = 6 if together else 5
    assert [o.usage.cached_tokens for o in shared] == [0, copied, copied, copied]
    if together:
        assert stats["in_step_shared_tokens"] == 3 * 6 and stats["tail_hit_tokens"] == 0
        assert stats["steps"] == 1
    else:
        assert stats["tail_hit_tokens"] == 3 * 5 and stats["in_step_shared_tokens"] == 0
    assert_equal_to_cold_and_hf(hf, items, shared, cold)


def test_a_kept_tail_serves_generation_without_scores(model_dir: Path) -> None:
    """A request that does not score takes every token it shares with a kept tail (but its
    last), and generates what it generates without the tail (greedy)."""
    rng = random.Random(23)
    prompt = [rng.randrange(3, VOCAB) for _ in range(11)]
    params = SamplingParams(max_new_tokens=4, temperature=0.0)

    async def run(prefix_cache: bool) -> list:
        async with AsyncEngine(engine_config(model_dir, prefix_cache)) as engine:
            engine.step_hooks.append(lambda plan: engine.core.check_invariant())
            return [await engine.generate(prompt, params) for _ in range(2)]

    on, off = asyncio.run(run(True)), asyncio.run(run(False))
    assert [o.usage.cached_tokens for o in on] == [0, 10]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


def test_the_score_cache_evicts_and_the_kv_invariant_holds(model_dir: Path) -> None:
    """A score cache of 2 pages under prompts of 4 scored pages each: pages come and go, a
    prompt whose early pages were evicted computes them again, and the scores and the KV
    accounting stay right."""
    rng = random.Random(11)
    items = [[rng.randrange(3, VOCAB) for _ in range(70)] for _ in range(3)]
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=2)

    async def run(score_cache_pages: int) -> tuple[list, dict]:
        async with AsyncEngine(engine_config(model_dir, True, score_cache_pages)) as engine:
            outs = []
            for prompt in [*items, items[0], items[2]]:
                outs.append(await engine.generate(prompt, params))
                engine.core.check_invariant()
            return outs, engine.stats()

    small, stats = asyncio.run(run(2))
    off, _ = asyncio.run(run(0))
    assert stats["prompt_score_pages"] == 2
    assert stats["prompt_score_pages_evicted"] == stats["prompt_score_pages_stored"] - 2 > 0
    # items[0] again: its page 0 was evicted, so nothing is taken; items[2] last: not evicted
    # only its last two pages stayed, and a match must start at page 0: nothing either
    assert [o.usage.cached_tokens for o in small] == [0, 0, 0, 0, 0]
    assert stats["prompt_score_hit_positions"] == 0
    for a, b in zip(small, off, strict=True):
        assert a.prompt_logprobs == b.prompt_logprobs


def test_sampled_rows_share_the_head_product_with_the_scored_ones() -> None:
    """``logits_and_scores``: the first rows' logits come back as they are (the step's sampled
    rows), the rest are scored as ``score_prompt_positions`` scores them, whichever chunk
    boundary falls between or inside the two."""
    torch.manual_seed(2)
    weight = torch.randn(50, 8)
    sampled, hidden = torch.randn(5, 8), torch.randn(7, 8)
    scorings = [PromptScoring(0, [4, 9, 11], 2), PromptScoring(1, [7, 8, 2, 3], 1)]
    alone = score_prompt_positions(hidden, scorings, lambda h: h @ weight.T)
    calls: list[int] = []

    def head(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ weight.T

    for chunk in (64, 5, 3):
        calls.clear()
        both = logits_and_scores(torch.cat([sampled, hidden]), 5, scorings, head, chunk_rows=chunk)
        assert calls == [min(chunk, 12 - b) for b in range(0, 12, chunk)]  # every row once
        assert both.logits.shape == (5, 50)
        torch.testing.assert_close(both.logits, sampled @ weight.T)
        for got, expected in zip(sum(both.scores, []), sum(alone, []), strict=True):
            assert got.token_logprob == pytest.approx(expected.token_logprob, abs=1e-5)
            assert [t for t, _ in got.top] == [t for t, _ in expected.top]
    leads = torch.tensor([0, 1, 2, 1, 3, 4, 5])  # positions reading one row (a lead)
    shared = logits_and_scores(torch.cat([sampled, hidden[:6]]), 5, scorings, head, 4, leads)
    copies = score_prompt_positions(hidden[:6][leads], scorings, lambda h: h @ weight.T)
    for got, expected in zip(sum(shared.scores, []), sum(copies, []), strict=True):
        assert got.token_logprob == pytest.approx(expected.token_logprob, abs=1e-5)
