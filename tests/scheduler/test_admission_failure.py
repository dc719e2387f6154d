"""An admission that fails after the request's KV was opened (its first chunk does not fit once
its matched prefix is locked and a kept tail page copied): the request waits with no copy left
behind."""

from __future__ import annotations

from asyncengine.core.engine_core import EngineCore
from tests.fake_executor import FakeExecutor, fake_core, reference_output
from tests.scheduler.test_scheduler import Clock, drive, submit

PAGE = 4
SHARED = list(range(1, 2 * PAGE + 1))  # two whole pages, cached by the first request
TAIL = [50, 51]  # the first request's last, partly filled page: kept as a tail


def make(num_pages: int, **overrides: object) -> tuple[EngineCore, FakeExecutor, Clock]:
    """No chunking: a prompt's first chunk is all of it, so it fits or fails whole."""
    clock = Clock()
    core, executor = fake_core(
        num_pages,
        PAGE,
        512,
        clock,
        chunked_prefill_size=0,
        enable_in_step_prefix_sharing=False,
        max_pinned_fraction=0.5,
        **overrides,
    )
    return core, executor, clock


def test_a_failed_admission_leaves_no_copy_over_a_host_tier_hit() -> None:
    """The page a failed admission took for its tail copy goes back to the free list; the next
    step hands it to a prefix copied back from the host tier, and a copy still recorded into
    it would overwrite those cached pages after the host copy lands."""
    core, runner, clock = make(32, host_kv_tier=True, swap_space_bytes=4096)
    pinned, host = list(range(300, 340)), list(range(400, 416))
    submit(core, clock, [(pinned, 1), (host, 1)], tag="a")
    drive(core, runner, clock)
    pin = core.pin(pinned)
    # a long prompt that evicts ``host`` to the host tier, aborted before its KV lands
    (filler,) = submit(core, clock, [(list(range(500, 576)), 1)], tag="f")
    plan = core.launch()
    assert plan is not None and plan.swap_out
    core.abort(filler.rid)
    core.land(plan, runner.execute(plan))
    submit(core, clock, [(SHARED + TAIL, 1)], tag="x")
    drive(core, runner, clock)
    # opened, the tail taken into a free page, then short of pages: the step runs nothing
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
