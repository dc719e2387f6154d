"""cache_salt in the engine core: requests with different salts share no prefix pages (their KV
is computed again), the same salt shares them as the unsalted cache does, the executor computes
on the real token ids (outputs equal the no-cache reference), and the KV invariant holds after
every step (CheckedEngine)."""

from __future__ import annotations

import pytest

from asyncengine.cache.manager import KVCacheManager
from asyncengine.common.cache_salt import salt_token, salted_ids
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from tests.api.test_engine_loop import assert_idle_and_clean, fake_engine, wait_idle
from tests.fake_executor import reference_output

PROMPT = list(range(10, 42))  # 32 tokens: 8 pages of 4


def params(salt: str | None = None, n: int = 1) -> SamplingParams:
    return SamplingParams(max_new_tokens=3, temperature=0, cache_salt=salt, n=n)


async def test_two_salts_share_nothing_and_the_same_salt_hits() -> None:
    engine = fake_engine()
    await engine.start()
    try:
        first = await engine.generate(PROMPT, params("alice"))
        assert first.usage.cached_tokens == 0
        computed = engine.stats()["miss_tokens"]
        other = await engine.generate(PROMPT, params("bob"))
        assert other.usage.cached_tokens == 0
        assert engine.stats()["miss_tokens"] == computed + len(PROMPT)  # computed again
        unsalted = await engine.generate(PROMPT, params(None))
        assert unsalted.usage.cached_tokens == 0
        again = await engine.generate(PROMPT, params("alice"))
        assert again.usage.cached_tokens == 28  # all whole pages but the last token's
        shared = await engine.generate(PROMPT, params(""))  # empty: the shared cache
        assert shared.usage.cached_tokens == 28
        expected = reference_output(PROMPT, 3)
        for out in (first, other, unsalted, again, shared):
            assert out.token_ids == expected  # computed on the real ids
        await wait_idle(engine)
        assert_idle_and_clean(engine)
    finally:
        await engine.stop()


async def test_salted_requests_together_in_one_step_share_nothing() -> None:
    """Sent at once, prompts of different salts neither wait for each other's pages nor copy
    them in the step (step_prefixes / step_shares compare the salted keys)."""
    import asyncio

    engine = fake_engine()
    await engine.start()
    try:
        outs = await asyncio.gather(
            *(engine.generate(PROMPT, params(f"tenant-{i}")) for i in range(4))
        )
        assert [o.usage.cached_tokens for o in outs] == [0, 0, 0, 0]
        assert engine.stats()["in_step_shared_tokens"] == 0
        assert engine.stats()["hit_tokens"] == 0
        choices = await engine.generate_choices(PROMPT, params("tenant-0", n=3))
        assert all(c.token_ids == reference_output(PROMPT, 3) for c in choices)
        assert choices[0].usage.cached_tokens == 28
        await wait_idle(engine)
        assert_idle_and_clean(engine)
    finally:
        await engine.stop()


def test_salted_keys_never_match_across_salts_in_the_manager() -> None:
    kv = KVCacheManager(num_pages=32, page_size=4, max_rows=4, max_pages_per_row=16)
    a, b = salted_ids(PROMPT, "a"), salted_ids(PROMPT, "b")
    assert a[1:] == b[1:] == PROMPT[1:] and a[0] != b[0] and min(a[0], b[0]) < 0
    seq = kv.open(a)
    kv.extend(seq, len(a))
    seq.computed_len = len(a)
    kv.close(seq, a, cache=True)
    assert kv.match_length(a) == 28 and kv.match_length(b) == 0 and kv.match_length(PROMPT) == 0
    kv.check_invariant()
    assert salt_token("a", None, 7) == salt_token("a", None, 7) != salt_token("a ", None, 7)
    # the first token is part of the key: prompts of one salt differing only there share nothing
    assert salt_token("a", None, 7) != salt_token("a", None, 8)


def test_the_salt_is_checked() -> None:
    assert SamplingParams(cache_salt="").cache_salt is None
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt="x" * 257)
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt=7)  # type: ignore[arg-type]
    req = Request("r", PROMPT, SamplingParams(cache_salt="s"), 0.0)
    assert req.all_ids == PROMPT and req.cache_ids[1:] == PROMPT[1:]
    assert req.cache_ids[0] == salt_token("s", None, PROMPT[0])
