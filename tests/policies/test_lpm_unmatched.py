"""LPM keeps a waiting request's "matches nothing" only until a prefix it could match is cached.

The policy skips the tree walk for a request whose cached prefix was 0 while no insert started
with its first token (``KVCacheManager.prefix_epoch``); its order must stay the one it gives
without that memo, through inserts, evictions and a reset of the cache.
"""

from __future__ import annotations

from asyncengine.cache.manager import KVCacheManager
from asyncengine.common.config import EngineConfig
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.policies import PolicyContext, make_policy

PAGE = 16


def _kv() -> KVCacheManager:
    return KVCacheManager(num_pages=16, page_size=PAGE, max_rows=4, max_pages_per_row=8)


def _cache(kv: KVCacheManager, prompt: list[int]) -> None:
    seq = kv.open(prompt)
    kv.extend(seq, len(prompt) - seq.kv_len)
    kv.close(seq, prompt)


def _ctx(kv: KVCacheManager, memo: bool, calls: list[int]) -> PolicyContext:
    def prefix_len(ids: list[int]) -> int:
        calls.append(1)
        return kv.match_length(ids)

    return PolicyContext(
        config=EngineConfig(),
        now=0.0,
        num_running=0,
        num_decodes=0,
        prefix_len=prefix_len,
        chunked=None,
        prefix_epoch=kv.prefix_epoch if memo else None,
    )


def _prompt(head: int, n: int = 3 * PAGE) -> list[int]:
    return [head] + [head * 100 + i for i in range(n - 1)]


def test_lpm_order_is_the_same_with_the_memo_through_inserts_evictions_and_a_reset() -> None:
    kv = _kv()
    waiting = [Request(f"r{h}", _prompt(h), SamplingParams(), 0.0) for h in (1, 2, 3, 4)]
    with_memo, without = make_policy("lpm"), make_policy("lpm")

    def check() -> list[str]:
        calls: list[int] = []
        memo_order = with_memo.order(waiting, _ctx(kv, True, calls))
        plain_order = without.order(waiting, _ctx(kv, False, []))
        assert [r.rid for r in memo_order] == [r.rid for r in plain_order]
        return [r.rid for r in memo_order]

    assert check() == ["r1", "r2", "r3", "r4"]  # nothing cached: arrival order
    calls: list[int] = []
    with_memo.order(waiting, _ctx(kv, True, calls))
    assert calls == []  # every "matches nothing" is kept: nothing was cached since

    _cache(kv, _prompt(3))  # r3's prompt is cached: r3's memo must go
    calls = []
    order = with_memo.order(waiting, _ctx(kv, True, calls))
    assert order[0].rid == "r3"
    assert len(calls) >= 1  # r3 was asked again; the others kept theirs
    assert check()[0] == "r3"

    _cache(kv, [9] * (2 * PAGE))  # another head: no memo changes, the order neither
    assert check()[0] == "r3"

    # fill the pool with other prompts until r3's prefix is evicted, then bring it back
    for head in range(20, 40):
        _cache(kv, _prompt(head, 4 * PAGE))
    assert kv.match_length(_prompt(3)) == 0
    assert check() == ["r1", "r2", "r3", "r4"]
    _cache(kv, _prompt(2))
    assert check()[0] == "r2"

    kv.reset()  # answers shrink; counts go on, so an old "nothing" is never trusted anew
    assert check() == ["r1", "r2", "r3", "r4"]
    _cache(kv, _prompt(4))
    assert check()[0] == "r4"


def test_a_finished_request_leaves_the_memo() -> None:
    kv = _kv()
    policy = make_policy("lpm")
    waiting = [Request(f"r{h}", _prompt(h), SamplingParams(), 0.0) for h in (1, 2)]
    policy.order(waiting, _ctx(kv, True, []))
    assert len(policy._unmatched) == 2  # type: ignore[attr-defined]
    policy.finished(waiting[0])
    assert len(policy._unmatched) == 1  # type: ignore[attr-defined]
