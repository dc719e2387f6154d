"""A kept tail page copied into a request's page before the next forward, given back for room
in the same step: a prefix copied back from the host tier into that page in the plan (host
copies run before tail copies) must not become what the request reads."""

from __future__ import annotations

from tests.fake_executor import reference_output
from tests.scheduler.test_admission_failure import SHARED, TAIL, make
from tests.scheduler.test_scheduler import drive, step, submit


def test_a_tail_reclaimed_in_its_step_still_gives_its_kv() -> None:
    # little memory kept for decodes: both new prompts below fit beside the running one
    core, runner, clock = make(
        36,
        host_kv_tier=True,
        swap_space_bytes=4096,
        init_new_token_ratio=0.01,
        min_new_token_ratio=0.01,
    )
    pinned, host = list(range(300, 340)), list(range(400, 416))
    submit(core, clock, [(pinned, 1), (host, 1)], tag="a")
    drive(core, runner, clock)
    core.pin(pinned)
    # a long prompt that evicts ``host`` to the host tier, aborted before its KV lands
    (filler,) = submit(core, clock, [(list(range(500, 592)), 1)], tag="f")
    plan = core.launch()
    assert plan is not None and plan.swap_out
    core.abort(filler.rid)
    core.land(plan, runner.execute(plan))
    submit(core, clock, [(SHARED + TAIL, 1), (list(range(700, 712)), 1)], tag="x")
    drive(core, runner, clock)
    submit(core, clock, [(list(range(800, 861)), 40)], tag="r")  # keeps 16 pages running
    step(core, runner, clock)
    kv = core.kv
    assert (kv.allocator.num_free, len(kv.tails)) == (4, 1)
    # the first takes the tail into one of the 4 free pages; the second's 4 host pages need
    # one more: the tail is given back
    prompts = [[*SHARED, *TAIL, 77], [*host, 999]]
    reqs = submit(core, clock, [(prompt, 3) for prompt in prompts], tag="n")
    plan = core.launch()
    assert plan is not None and len(plan.extends) == 2 and plan.swap_in
    core.land(plan, runner.execute(plan))
    drive(core, runner, clock)
    assert [req.cached_tokens for req in reqs] == [len(SHARED) + len(TAIL), len(host)]
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.output_ids == reference_output(prompt, 3), req.rid
