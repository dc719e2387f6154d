"""Admission and the KV its open takes: a request is admitted only when its first chunk fits in
the pages left once its open locks its cached prefix, so on a small pool with shared prefixes no
admission fails after the open. Where a prompt computed in chunks takes a kept tail's page or
the host tier's pages on top of its first chunk, one still may: the request waits with nothing
counted and no copy left behind, and is counted once when it is admitted."""

from __future__ import annotations

import pytest

from asyncengine.cache.pins import Pin
from asyncengine.common.request import RequestStatus
from asyncengine.core.engine_core import EngineCore
from tests.fake_executor import FakeExecutor, fake_core, reference_output
from tests.scheduler.test_preemption import short_core
from tests.scheduler.test_scheduler import Clock, drive, submit, workload

PAGE = 4
SHARED = list(range(1, 2 * PAGE + 1))  # two whole pages, cached by the first request
TAIL = [50, 51]  # the first request's last, partly filled page: kept as a tail


def make(
    num_pages: int, chunk: int = 0, **overrides: object
) -> tuple[EngineCore, FakeExecutor, Clock]:
    """Prompts computed in chunks of ``chunk`` tokens (0: whole)."""
    clock = Clock()
    core, executor = fake_core(
        num_pages,
        PAGE,
        512,
        clock,
        chunked_prefill_size=chunk,
        enable_in_step_prefix_sharing=False,
        max_pinned_fraction=0.5,
        **overrides,
    )
    return core, executor, clock


def failed(core: EngineCore) -> int:
    return int(core.stats()["failed_admissions"])


@pytest.mark.parametrize("skips", [0, 3])
@pytest.mark.parametrize("chunk", [0, 8])
def test_no_admission_fails_on_a_small_pool_with_shared_prefixes(chunk: int, skips: int) -> None:
    """Requests sharing prefixes on a 24-page pool, retracted on KV shortage: none is opened
    and then refused (its cached prefix, once locked, is not room for its first chunk)."""
    retracted = 0
    for seed in range(6):
        core, runner, clock = short_core(
            num_pages=24, chunked_prefill_size=chunk, kv_blocked_skips=skips
        )
        items = [(p, n) for p, n in workload(seed=seed, n=16, max_out=40) if len(p) + n <= 96]
        reqs = submit(core, clock, items)
        drive(core, runner, clock)
        assert failed(core) == 0, f"seed {seed}"
        retracted += int(core.stats()["retractions"])
        for req, (prompt, n) in zip(reqs, items, strict=True):
            assert req.output_ids == reference_output(prompt, n), req.rid
    assert retracted > 0  # the pool is short


def counters(core: EngineCore) -> tuple[int, int, int]:
    kv = core.kv
    return kv.hit_tokens, kv.miss_tokens, kv.tails.hit_tokens


def host_tier_holding_a_prefix() -> tuple[EngineCore, FakeExecutor, Clock, Pin, list[int]]:
    """A 32-page pool computing prompts in chunks of 80 tokens, 10 pages of it pinned, and
    ``host``'s 4 pages evicted to the host tier (by a long prompt aborted before its KV
    landed)."""
    core, runner, clock = make(32, chunk=80, host_kv_tier=True, swap_space_bytes=4096)
    pinned, host = list(range(300, 340)), list(range(400, 416))
    submit(core, clock, [(pinned, 1), (host, 1)], tag="a")
    drive(core, runner, clock)
    pin = core.pin(pinned)
    (filler,) = submit(core, clock, [(list(range(500, 576)), 1)], tag="f")
    plan = core.launch()
    assert plan is not None and plan.swap_out
    core.abort(filler.rid)
    core.land(plan, runner.execute(plan))
    return core, runner, clock, pin, host


def test_a_prompt_whose_first_chunk_cannot_fit_is_not_opened() -> None:
    """Alone, a request is admitted whatever its reservation; its first chunk must still fit
    in the pages its open leaves: where it cannot, it waits unopened, not opened and undone."""
    core, runner, clock = make(16)
    pinned = list(range(100, 116))  # four whole pages, pinned below
    submit(core, clock, [(SHARED + TAIL, 1), (pinned, 1)], tag="x")
    drive(core, runner, clock)
    pin = core.pin(pinned)
    kv = core.kv
    before = counters(core)
    (tail_page,) = kv.tails.pages()
    # 11 uncached pages where 12 are free, evictable or a kept tail, 2 of them its own prefix
    prompt = SHARED + TAIL + list(range(200, 240))
    (req,) = submit(core, clock, [(prompt, 2)], tag="y")
    assert kv.available_pages == 12 and kv.match_room(prompt) == (len(SHARED), 10)
    assert core.launch() is None
    assert req.status is RequestStatus.WAITING and req.seq is None
    assert failed(core) == 0 and counters(core) == before
    assert kv.tails.pages() == [tail_page] and kv.drain_page_copies() == []
    core.unpin(pin.pin_id)
    drive(core, runner, clock)
    assert req.cached_tokens == len(SHARED) + len(TAIL)
    assert req.output_ids == reference_output(prompt, 2)


def test_a_failed_admission_is_counted_once_when_it_succeeds() -> None:
    core, runner, clock = make(8, chunk=8)
    pinned = list(range(100, 116))  # four whole pages, pinned below
    submit(core, clock, [(SHARED + TAIL, 1), (pinned, 1)], tag="x")
    drive(core, runner, clock)
    pin = core.pin(pinned)
    prompt = SHARED + TAIL + list(range(200, 214))  # its first chunk: 2 pages after the match
    kv = core.kv
    before = counters(core)
    hits, misses, tail_hits = before
    (req,) = submit(core, clock, [(prompt, 2)], tag="y")
    assert kv.match_room(prompt) == (len(SHARED), 2)
    # opened (its 2 cached pages locked), the tail copied into the one free page, then its
    # first chunk of 8 tokens after the tail's 2 wants 2 more pages where the tail is 1
    (tail_page,) = kv.tails.pages()
    assert core.launch() is None
    assert failed(core) == 1
    assert req.status is RequestStatus.WAITING and req.seq is None
    assert counters(core) == before, "a failed admission was counted"
    assert kv.drain_page_copies() == [], "a failed admission left its tail copy behind"
    kv.check_invariant()
    core.unpin(pin.pin_id)
    plan = core.launch()  # the pinned pages may go now
    assert plan is not None and [seg.rid for seg in plan.extends] == [req.rid]
    # making room gives the kept tail back first: the request takes its page, not a copy
    assert plan.page_copies == [] and req.kv.pages[2] == tail_page
    core.land(plan, runner.execute(plan))
    drive(core, runner, clock)
    taken = len(SHARED) + len(TAIL)
    assert req.cached_tokens == taken
    assert counters(core) == (hits + taken, misses + len(prompt) - taken, tail_hits + len(TAIL))
    assert req.output_ids == reference_output(prompt, 2)


def test_a_failed_admission_leaves_no_copy_over_a_host_tier_hit() -> None:
    """The page a failed admission took for its tail copy goes back to the free list; the next
    step hands it to a prefix copied back from the host tier, and a copy still recorded into
    it would overwrite those cached pages after the host copy lands."""
    core, runner, clock, pin, host = host_tier_holding_a_prefix()
    submit(core, clock, [(SHARED + TAIL, 1)], tag="x")
    drive(core, runner, clock)
    # its first chunk (80 of 84 uncached tokens) fits the room its open leaves, but opened,
    # the tail taken into a free page, the chunk after the tail's 2 tokens is a page short
    (blocked,) = submit(core, clock, [(SHARED + TAIL + list(range(600, 682)), 1)], tag="y")
    assert core.launch() is None
    core.abort(blocked.rid)
    prompt = [*host, 999]
    (req,) = submit(core, clock, [(prompt, 2)], tag="z")
    plan = core.launch()
    assert plan is not None and plan.swap_in
    core.land(plan, runner.execute(plan))
    drive(core, runner, clock)
    assert req.cached_tokens == len(host) and core.kv.host_hit_tokens == len(host)
    assert req.output_ids == reference_output(prompt, 2)
    core.unpin(pin.pin_id)


def test_copied_back_pages_count_as_host_hits_once_a_failed_admission_gets_in() -> None:
    """The host tier's pages a prompt's open copied back stay in the tree when its admission
    fails; they are counted (as host-tier hits too) when it is admitted, not before."""
    core, runner, clock, pin, host = host_tier_holding_a_prefix()
    kv = core.kv
    hits = kv.hit_tokens
    # its first chunk (80 tokens) fits the room its open leaves, but opened, ``host`` copied
    # back into 4 of the 22 free pages, the chunk after it wants 19 more
    prompt = host + list(range(600, 676))
    (req,) = submit(core, clock, [(prompt, 2)], tag="y")
    assert core.launch() is None
    assert req.status is RequestStatus.WAITING and kv.tree.prefix_length(host) == len(host)
    assert (kv.hit_tokens, kv.host_hit_tokens) == (hits, 0), "a failed admission was counted"
    core.unpin(pin.pin_id)
    drive(core, runner, clock)  # found in the tree now, as the copy left it
    assert req.cached_tokens == len(host)
    assert (kv.hit_tokens, kv.host_hit_tokens) == (hits + len(host), len(host))
    assert req.output_ids == reference_output(prompt, 2)


def test_a_request_waiting_for_room_is_not_looked_up_again_while_the_tree_is_unchanged() -> None:
    """A request that cannot start is asked about every step: its cached prefix is found by
    one walk of the tree, kept while nothing is inserted under its first token, and dropped
    once it is admitted."""
    core, runner, clock = make(16)
    pinned = list(range(100, 116))
    submit(core, clock, [(SHARED + TAIL, 1), (pinned, 1)], tag="x")
    drive(core, runner, clock)
    pin = core.pin(pinned)
    prompt = SHARED + TAIL + list(range(200, 240))  # does not fit beside the pinned pages
    (req,) = submit(core, clock, [(prompt, 2)], tag="y")
    ends = core.scheduler.prefill.prefix_ends
    assert core.launch() is None
    first = ends[id(req)]
    assert first.matched == len(SHARED)
    for _ in range(3):
        assert core.launch() is None
        assert ends[id(req)] is first  # answered from its last answer: no walk
    core.unpin(pin.pin_id)
    drive(core, runner, clock)
    assert id(req) not in ends
    assert req.cached_tokens == len(SHARED) + len(TAIL)
    assert req.output_ids == reference_output(prompt, 2)
