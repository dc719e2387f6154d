"""A policy asks each waiting request's cached prefix every step (``PolicyContext.cached_prefix``):
the scheduler keeps the answer (a ``PrefixEnd``) while the request waits and walks the tree again
only when the cache under it changed, so a long cached context costs the same step after step.
A walk makes a new ``PrefixEnd``; an answer kept is the same object, so walks are counted by
identity. The answer follows an insert under the request's first token and an eviction of its
pages, and LPM's order is the one it gives asking ``prefix_len`` of the whole context."""

from __future__ import annotations

import pytest

from asyncengine.cache.manager import KVCacheManager
from asyncengine.common.request import Request, RequestStatus
from asyncengine.core.engine_core import EngineCore
from asyncengine.policies import PolicyContext, make_policy
from tests.scheduler.test_scheduler import Clock, make_scheduler, submit

PAGE = 4
NUM_PAGES = 64


def cache(kv: KVCacheManager, prompt: list[int]) -> None:
    """Compute ``prompt`` outside the scheduler and keep it in the tree."""
    seq = kv.open(prompt)
    kv.extend(seq, len(prompt) - seq.kv_len)
    kv.close(seq, prompt)


def context(core: EngineCore) -> PolicyContext:
    return core.scheduler._context(0)


def plain(ctx: PolicyContext) -> PolicyContext:
    """The same context without kept answers: every question walks the tree."""
    return PolicyContext(
        config=ctx.config,
        now=ctx.now,
        num_running=ctx.num_running,
        num_decodes=ctx.num_decodes,
        prefix_len=ctx.prefix_len,
        chunked=ctx.chunked,
        prefix_epoch=ctx.prefix_epoch,
        cache_epoch=ctx.cache_epoch,
    )


def long_prompt(head: int, n: int) -> list[int]:
    return [head] + [head * 1000 + i for i in range(n - 1)]


def waiting_core(prompts: list[list[int]]) -> tuple[EngineCore, Clock, list[Request]]:
    """An LPM scheduler with ``prompts`` waiting, never launched (nothing admits them)."""
    core, _, clock = make_scheduler(NUM_PAGES, PAGE, policy="lpm")
    reqs = submit(core, clock, [(prompt, 4) for prompt in prompts])
    assert all(req.status is RequestStatus.WAITING for req in reqs)
    return core, clock, reqs


def test_a_waiting_request_is_not_walked_again_while_the_tree_is_unchanged() -> None:
    context_tokens = long_prompt(3, 40 * PAGE + 2)
    core, _, (req,) = waiting_core([context_tokens])
    kv = core.kv
    cache(kv, context_tokens[: 30 * PAGE])
    ends = core.scheduler.prefill.prefix_ends
    assert context(core).cached_prefix(req) == 30 * PAGE
    first = ends[id(req)]
    cache(kv, long_prompt(9, 2 * PAGE))  # another first token: nothing under req changed
    for _ in range(5):
        assert context(core).cached_prefix(req) == 30 * PAGE
        assert ends[id(req)] is first  # no walk

    cache(kv, context_tokens[: 35 * PAGE])  # an insert under its head: the answer grows
    assert context(core).cached_prefix(req) == 35 * PAGE
    grown = ends[id(req)]
    assert grown is not first
    assert context(core).cached_prefix(req) == 35 * PAGE
    assert ends[id(req)] is grown

    # other prompts take the pool until its pages are evicted: the answer shrinks
    for head in range(20, 40):
        cache(kv, long_prompt(head, 16 * PAGE))
    assert kv.match_length(context_tokens) == 0
    assert context(core).cached_prefix(req) == 0

    core.abort(req.rid)  # it leaves the queue: its answer goes with it
    assert id(req) not in ends


def test_lpm_keeps_each_waiting_answer_and_orders_as_by_prefix_len() -> None:
    prompts = [long_prompt(head, 24 * PAGE + 1) for head in (1, 2, 3)]
    core, clock, reqs = waiting_core(prompts)
    kv = core.kv
    cache(kv, prompts[2][: 20 * PAGE])
    cache(kv, prompts[1][: 8 * PAGE])
    policy, reference = make_policy("lpm"), make_policy("lpm")
    ends = core.scheduler.prefill.prefix_ends

    def order() -> list[str]:
        ctx = context(core)
        got = [req.rid for req in policy.order(reqs, ctx)]
        assert got == [req.rid for req in reference.order(reqs, plain(ctx))]
        return got

    assert order() == ["r2", "r1", "r0"]
    kept = {rid: ends.get(id(req)) for rid, req in zip(("r1", "r2"), reqs[1:], strict=True)}
    assert None not in kept.values()  # each cached one's answer is kept by LPM's question
    for _ in range(5):
        clock.t += 1.0
        assert order() == ["r2", "r1", "r0"]
        assert ends[id(reqs[1])] is kept["r1"] and ends[id(reqs[2])] is kept["r2"]  # no walk

    cache(kv, prompts[1][: 22 * PAGE])  # r1's prefix grows past r2's
    assert order() == ["r1", "r2", "r0"]
    assert ends[id(reqs[1])] is not kept["r1"]
    assert ends[id(reqs[2])] is kept["r2"]  # another head: r2's still holds


# sjf puts the cached one first; slo, with no prefill timing learnt yet, keeps arrival order
@pytest.mark.parametrize(
    ("name", "options", "first"), [("sjf", {}, "r1"), ("slo", {"ttft_ms": 500.0}, "r0")]
)
def test_other_policies_ordering_by_cached_prefix_keep_the_answers(
    name: str, options: dict[str, object], first: str
) -> None:
    prompts = [long_prompt(head, 24 * PAGE + 1) for head in (1, 2)]
    core, clock, reqs = waiting_core(prompts)
    cache(core.kv, prompts[1][: 20 * PAGE])
    policy, reference = make_policy(name, options), make_policy(name, options)
    ends = core.scheduler.prefill.prefix_ends
    ctx = context(core)
    order = policy.order(reqs, ctx)
    assert order == reference.order(reqs, plain(ctx)) and order[0].rid == first
    kept = ends[id(reqs[1])]
    for _ in range(3):
        clock.t += 0.01
        ctx = context(core)
        assert policy.order(reqs, ctx) == reference.order(reqs, plain(ctx)) == order
        assert ends[id(reqs[1])] is kept  # no walk


def test_an_admitted_request_drops_its_answer() -> None:
    prompt = long_prompt(5, 6 * PAGE + 1)
    core, _, (req,) = waiting_core([prompt])
    cache(core.kv, prompt[: 4 * PAGE])
    assert context(core).cached_prefix(req) == 4 * PAGE
    assert id(req) in core.scheduler.prefill.prefix_ends
    assert core.launch() is not None
    assert req.status is not RequestStatus.WAITING
    assert id(req) not in core.scheduler.prefill.prefix_ends
    assert context(core).cached_prefix(req) == 4 * PAGE  # asked about anyway: nothing kept
    assert id(req) not in core.scheduler.prefill.prefix_ends
