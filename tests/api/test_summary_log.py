"""The one periodic summary line: rates over the interval, extra counters of a front end, and
silence while nothing changes (an idle server does not log every interval forever); its prompt
rate is what the forwards computed, so a long prompt's chunked prefill shows as it runs."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import pytest

from asyncengine.api.summary_log import SummaryLog
from asyncengine.common.sampling_params import SamplingParams
from tests.api.test_engine_loop import fake_engine

IDLE: dict[str, Any] = {
    "running": 0,
    "prefilling": 0,
    "waiting": 0,
    "generated_tokens": 0,
    "prefill_computed_tokens": 0,
    "hit_tokens": 0,
    "miss_tokens": 0,
    "retractions": 0,
    "pages_used": 0,
    "pages_cached": 0,
    "pages_total": 64,
}

# what the operator greps for (the server tests match the same shape)
LINE = re.compile(
    r"prefilling=\d+ running=\d+ waiting=\d+ (\w+=\d+ )*gen_tok/s=[\d.]+ prompt_tok/s=[\d.]+ "
    r"cache_hit=[\d.]+% kv_pages used=\d+ cached=\d+ total=\d+"
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_engine_logs_nothing() -> None:
    stats = dict(IDLE)
    clock = Clock()
    summary = SummaryLog(lambda: stats, clock)
    summary.reset()
    for _ in range(5):
        clock.now += 10
        assert summary.line() is None


def test_activity_logs_rates_then_one_line_as_it_ends_then_silence() -> None:
    stats = dict(IDLE)
    clock = Clock()
    served = [0.0]
    summary = SummaryLog(lambda: stats, clock)
    summary.reset()
    summary.add_counter("http_requests", lambda: served[0])
    stats.update(running=2, generated_tokens=50, hit_tokens=30, miss_tokens=90, pages_used=5)
    stats.update(prefill_computed_tokens=120)
    served[0] = 3
    clock.now += 10
    line = summary.line()
    assert line is not None and LINE.search(line), line
    assert "prefilling=0 running=2 waiting=0 http_requests=3 gen_tok/s=5.0 " in line
    assert "prompt_tok/s=12.0 cache_hit=25.0% kv_pages used=5 cached=0 total=64" in line
    assert "retractions" not in line
    # the requests finish: counters moved once more, then everything stands still
    stats.update(running=0, generated_tokens=60, pages_used=0, pages_cached=5, retractions=2)
    clock.now += 10
    line = summary.line()
    assert line is not None
    assert "running=0" in line and "http_requests=0 gen_tok/s=1.0" in line
    assert line.endswith("retractions=2")
    for _ in range(3):
        clock.now += 10
        assert summary.line() is None


def test_a_long_prompts_chunks_count_as_they_are_computed() -> None:
    """An 8,000-token prompt admitted at once and computed 1,000 tokens a second: each line
    says 100 tok/s over its 10 s, not 800 for the first and 0 for the rest."""
    stats = dict(IDLE)
    clock = Clock()
    summary = SummaryLog(lambda: stats, clock)
    summary.reset()
    stats.update(prefilling=1, miss_tokens=8000, pages_used=64)
    rates = []
    for computed in (1000, 2000, 3000):
        stats["prefill_computed_tokens"] = computed
        clock.now += 10
        line = summary.line()
        assert line is not None and LINE.search(line), line
        rates.append(line.split("prompt_tok/s=")[1].split()[0])
    assert rates == ["100.0", "100.0", "100.0"]


@pytest.mark.asyncio
async def test_the_engine_counts_the_prompt_tokens_its_forwards_computed() -> None:
    """A chunked prompt's every token once; sent again, only what the prefix cache lacks."""
    async with fake_engine(chunked_prefill_size=8, max_prefill_tokens=8) as engine:
        prompt = list(range(3, 43))  # 40 tokens: five chunks
        await engine.generate(prompt, SamplingParams(max_new_tokens=2))
        first = engine.stats()["prefill_computed_tokens"]
        assert first == 40
        await engine.generate(prompt, SamplingParams(max_new_tokens=2))
        again = engine.stats()["prefill_computed_tokens"] - first
        assert 0 < again < 40 and again == 40 - engine.stats()["hit_tokens"]


def test_a_step_longer_than_the_interval_is_averaged_over_its_whole_time() -> None:
    """A 3,000-token chunk that takes 30 s: the intervals it spans log nothing, and the line
    after it says 100 tok/s, not 3,000 over the last 10 s alone; idle time counts for none."""
    stats = dict(IDLE)
    clock = Clock()
    summary = SummaryLog(lambda: stats, clock)
    summary.reset()
    clock.now += 600  # idle
    assert summary.line() is None
    stats.update(prefilling=1, running=1, miss_tokens=3000, pages_used=200)
    clock.now += 10
    assert summary.line() is not None  # admitted: the gauges changed
    for _ in range(2):
        clock.now += 10
        assert summary.line() is None  # the step runs on
    stats.update(prefill_computed_tokens=3000, generated_tokens=3)
    clock.now += 10
    line = summary.line()
    assert line is not None and "gen_tok/s=0.1 prompt_tok/s=100.0 " in line, line


def test_a_gauge_that_changes_alone_is_logged_once() -> None:
    """A request waiting with nothing running moves no counter, but the operator must see it."""
    stats = dict(IDLE)
    clock = Clock()
    summary = SummaryLog(lambda: stats, clock)
    summary.reset()
    stats["waiting"] = 1
    clock.now += 10
    line = summary.line()
    assert line is not None and "waiting=1" in line
    clock.now += 10
    assert summary.line() is None


@pytest.mark.asyncio
async def test_the_engine_writes_summaries_only_while_something_happens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="asyncengine.api.engine")

    def summaries() -> list[str]:
        return [r.getMessage() for r in caplog.records if LINE.search(r.getMessage())]

    async with fake_engine(log_interval=0.01) as engine:
        await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=8))
        for _ in range(500):  # the line of the interval that saw the request
            if any("gen_tok/s=0.0 " not in s for s in summaries()):
                break
            await asyncio.sleep(0.01)
        assert any("gen_tok/s=0.0 " not in s for s in summaries()), summaries()
        # Once idle the line stops: run many intervals and count what they wrote.
        engine.summary.line()  # whatever the last interval had not logged yet
        written = len(summaries())
        await asyncio.sleep(0.3)
        assert len(summaries()) == written
