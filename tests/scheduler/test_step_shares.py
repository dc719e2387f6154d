"""Prompts of one step that share uncached tokens (step_shares.py): one computes them, the
others copy their KV in each layer of the same forward and take their prompt scores. Scores
equal a cold run's and HF's, greedy continuations equal a run without any sharing, the KV
invariant holds after every step."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.common.plan import BatchPlan, PromptScoring
from asyncengine.scheduler.step_shares import StepSegment, StepShares
from tests.executor.test_prompt_logprobs import assert_equal_to_cold_and_hf, engine_config
from tests.hf_scorer import HFScorer, hf, model_dir  # noqa: F401  (fixtures)
from tests.server_support import TINY_MODEL

VOCAB = TINY_MODEL["vocab_size"]


def one_step_config(model_dir: Path, sharing: bool = True) -> EngineConfig:
    """Every prompt below fits one step; in-batch dedup off, so nobody waits a step."""
    return engine_config(model_dir, True).replace(
        max_prefill_tokens=1024,
        chunked_prefill_size=1024,
        enable_inbatch_prefix_dedup=False,
        enable_in_step_prefix_sharing=sharing,
    )


async def run_together(
    config: EngineConfig, items: list[list[int]], params: SamplingParams
) -> tuple[list, dict, list[BatchPlan]]:
    plans: list[BatchPlan] = []
    async with AsyncEngine(config) as engine:
        engine.step_hooks.append(lambda plan: (plans.append(plan), engine.core.check_invariant()))
        outs = list(await asyncio.gather(*(engine.generate(p, params) for p in items)))
        return outs, engine.stats(), plans


def test_choices_sent_together_share_their_context_across_pages(
    model_dir: Path, hf: HFScorer
) -> None:
    """A 37-token context (two whole pages and a part) and four choices in one step: the
    first computes the context, the second copies it from the first, the third and fourth
    copy part of it from the second, which resolves to the first (a copy never reads a copy).
    The last copied position of each is scored from the final hidden state of the segment
    computing it, against the copier's own next token (its lead): the third's score at
    position 36 is the second's (both go on with the branch), not the first's."""
    rng = random.Random(5)
    context = [rng.randrange(3, VOCAB) for _ in range(37)]
    branch = [rng.randrange(3, VOCAB) for _ in range(4)]
    items = [
        context + [rng.randrange(3, VOCAB) for _ in range(3)],
        context + branch + [rng.randrange(3, VOCAB)],
        context + branch + [rng.randrange(3, VOCAB) for _ in range(2)],
        context[:20] + [rng.randrange(3, VOCAB) for _ in range(5)],
    ]
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1)
    shared, stats, plans = asyncio.run(run_together(one_step_config(model_dir), items, params))
    cold = [
        asyncio.run(run_together(engine_config(model_dir, False), [p], params))[0][0] for p in items
    ]
    assert stats["steps"] == 1
    # sharing c tokens, a scoring prompt copies all c positions: the second shares 37 with
    # the first, the third 41 with the second (37 of them the first's), the fourth 20 with
    # the first
    assert [o.usage.cached_tokens for o in shared] == [0, 37, 41, 20]
    assert stats["in_step_shared_tokens"] == 37 + 41 + 20
    assert [len(s.input_ids) for s in plans[0].extends] == [40, 5, 2, 5]
    assert len(plans[0].kv_copies) == 37 + 41 + 20
    extends = plans[0].extends
    rids = [s.rid for s in extends]
    leads = [(s.scoring.first, s.scoring.lead) for s in extends if s.scoring is not None]
    assert leads == [(0, None), (36, rids[0]), (40, rids[1]), (19, rids[0])]
    assert_equal_to_cold_and_hf(hf, items, shared, cold)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_generation_goes_on_from_copied_kv(model_dir: Path, backend: str) -> None:
    """Requests that do not score take every shared token but their last; their greedy
    continuations (decode steps reading the copied KV) equal those of a run that shares
    nothing. The Triton backend (interpreted here) stores K/V inside its attention, so the
    layer stores and copies before it: the path a GPU takes."""
    rng = random.Random(9)
    context = [rng.randrange(3, VOCAB) for _ in range(21)]
    items = [context + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 1, 5)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    config = one_step_config(model_dir).replace(attention_backend=backend)
    shared, stats, _ = asyncio.run(run_together(config, items, params))
    alone, alone_stats, _ = asyncio.run(
        run_together(one_step_config(model_dir, sharing=False), items, params)
    )
    assert stats["in_step_shared_tokens"] == 2 * 21 and alone_stats["in_step_shared_tokens"] == 0
    assert [o.token_ids for o in shared] == [o.token_ids for o in alone]


def test_pieces_resolve_copies_to_the_segment_that_computes_them() -> None:
    shares = StepShares(page_size=4)
    ids = list(range(10, 30))
    first = StepSegment("a", ids, [0, 1, 2, 3, 4], 0, 12, None)
    second = StepSegment("b", ids, [5, 6, 7, 8, 9], 2, 16, None, copied=8, source=first)
    shares.add(first)
    shares.add(second)
    found = shares.best(ids, 6, 9)
    assert found is not None and found[0] is second and found[1] == 9  # up to b's end
    pieces = shares.pieces(second, 6, 15)
    assert [(p.segment.rid, p.begin, p.end) for p in pieces] == [("a", 6, 10), ("b", 10, 15)]
    assert shares.slot(second.pages, 6) == 6 * 4 + 2
    other = [*ids[:5], 99, *ids[6:]]
    assert shares.best(other, 6, 9) is None  # a different token before ``at``


def test_a_lead_position_scores_from_the_segment_that_leads_there() -> None:
    """``b`` copied positions 2 .. 9 from ``a`` and scores position 9 itself (its lead: its
    next token differs from ``a``'s): scores of 6 .. 8 resolve to ``a``, of 9 on to ``b``;
    its KV at 9 still resolves to ``a``."""
    shares = StepShares(page_size=4)
    ids = list(range(10, 30))
    a = StepSegment("a", ids, [0, 1, 2, 3, 4], 0, 12, PromptScoring(0, ids[1:12], 1))
    b = StepSegment(
        "b", ids, [5, 6, 7, 8, 9], 2, 16, PromptScoring(9, ids[10:16], 1, "a"), 8, a, "a"
    )
    spans = shares.score_pieces(b, 6, 12)
    assert [(p.segment.rid, p.begin, p.end) for p in spans] == [("a", 6, 9), ("b", 9, 12)]
    assert [(p.segment.rid, p.begin, p.end) for p in shares.pieces(b, 9, 10)] == [("a", 9, 10)]


def test_best_finds_the_same_segment_by_looking_at_each_or_by_the_page_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step of a few segments is looked through one by one, a larger one through its page
    index: the same answers, the same order among equals."""
    rng = random.Random(5)
    bases = [[rng.randrange(3) for _ in range(40)] for _ in range(3)]
    segments = []
    for k in range(20):
        start = rng.randrange(0, 30)
        end = rng.randrange(start + 1, 41)
        segments.append(StepSegment(f"r{k}", bases[k % 3], list(range(10)), start, end, None))
    queries = []
    for _ in range(300):
        base, at = rng.choice(bases), rng.randrange(0, 39)
        keep = rng.randrange(at, 41)
        queries.append(([*base[:keep], *(rng.randrange(3) for _ in range(40 - keep))], at))

    def answers(scan_at_most: int, count: int) -> list[tuple[str, int] | None]:
        monkeypatch.setattr("asyncengine.scheduler.step_shares._SCAN_AT_MOST", scan_at_most)
        shares = StepShares(page_size=4)
        out: list[tuple[str, int] | None] = []
        for seg in segments[:count]:
            shares.add(seg)
        for ids, at in queries:
            found = shares.best(ids, at, 40 - at)
            out.append(None if found is None else (found[0].rid, found[1]))
        return out

    for count in (1, 5, 20):
        scanned, indexed = answers(100, count), answers(0, count)
        assert scanned == indexed
        assert any(found is not None for found in scanned)
