"""The CPU step's thread count chosen by measurement (executor/cpu/step_threads.py): which count
each step gets as the load comes and goes, and that the count never changes a result."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.executor.cpu.step_threads import (
    CHOOSE_BELOW_ROWS,
    CHOOSE_DECODE_ROWS,
    CONTENDED_SHARE,
    FIRST_EXPLORE_AFTER,
    MOST_EXPLORE_AFTER,
    StepThreads,
    run_on_chosen_threads,
    step_threads,
)
from asyncengine.executor.layers.linear import make_linear
from asyncengine.kernels.cpu import quant_native
from asyncengine.kernels.cpu.attention_native import native_decode_attention, plan_native_decode
from asyncengine.kernels.cpu.plan_threads import plan_threads, planning_for
from tests.conftest import TinyCheckpoint
from tests.executor.lora_support import write_adapters
from tests.executor.test_decode_step_long import long_row
from tests.executor.test_lora_parity import REQUESTS, _greedy, _harness
from tests.executor.test_model_parity import Harness
from tests.native_support import needs_native

ROWS = 40  # a scoring step of lm-eval's (16-127 rows: one class)


class FakeMachine:
    """Step times per row for each thread count, as the test sets them, and the share of the
    cores the process's threads get while they run (1.0: a quiet machine)."""

    def __init__(self, per_row: dict[int, float], cpu_share: float = 1.0) -> None:
        self.per_row = per_row
        self.cpu_share = cpu_share
        self.now = 0.0
        self.cpu = 0.0
        self.threads = max(per_row)  # the process starts on all threads
        self.counts: list[int] = []

    def set_threads(self, n: int) -> None:
        self.threads = n

    def clock(self) -> float:
        return self.now

    def cpu_clock(self) -> float:
        return self.cpu

    def step(self, chooser: StepThreads, rows: int = ROWS, prompt_rows: bool = True) -> int:
        def forward() -> int:
            seconds = self.per_row[self.threads] * rows
            self.now += seconds
            self.cpu += seconds * self.threads * self.cpu_share
            return self.threads

        threads = run_on_chosen_threads(
            chooser, rows, prompt_rows, forward, self.set_threads, self.clock, self.cpu_clock
        )
        assert self.threads == chooser.most  # set back after the step
        self.counts.append(threads)
        return threads


def test_a_quiet_machine_stays_on_all_threads_and_tries_one_ever_more_rarely() -> None:
    machine = FakeMachine({2: 1.0, 1: 1.6})
    chooser = StepThreads(2)
    for _ in range(1000):
        machine.step(chooser)
    assert machine.counts[:4] == [1, 1, 2, 2]  # a warm-up, one kept step, all tried: faster
    tries = [i for i, n in enumerate(machine.counts) if n == 1][2:]  # of one thread, on two
    assert tries[0] - 2 == FIRST_EXPLORE_AFTER  # after the try of two threads at step 2
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert gaps == [32, 64, 128, 256, 256]  # doubling after each try that loses, capped
    assert gaps[-1] == MOST_EXPLORE_AFTER


def test_the_load_coming_moves_the_steps_to_one_thread_at_once_and_back_when_it_goes() -> None:
    machine = FakeMachine({2: 1.0, 1: 1.6})
    chooser = StepThreads(2)
    for _ in range(10):
        machine.step(chooser)
    machine.per_row[2] = 6.0  # another process takes a core: two spinning threads crawl
    machine.step(chooser)
    assert machine.step(chooser) == 1  # the slow step had the other count tried next
    assert [machine.step(chooser) for _ in range(10)] == [1] * 10
    machine.per_row[2] = 1.0  # the load goes: found at the next try of two threads
    after = [machine.step(chooser) for _ in range(FIRST_EXPLORE_AFTER + 5)]
    assert 2 in after
    assert after[after.index(2) :] == [2] * (len(after) - after.index(2))


def test_classes_are_measured_apart() -> None:
    """Prompt steps of 4 and 40 rows keep their own times: a count slow for one is not taken
    as slow for the other."""
    machine = FakeMachine({2: 1.0, 1: 3.0})
    chooser = StepThreads(2)
    for _ in range(5):
        machine.step(chooser, rows=40)
    machine.per_row = {2: 5.0, 1: 1.0}  # say steps of 4 rows run faster on one thread
    counts = [machine.step(chooser, rows=4) for _ in range(5)]
    assert counts == [1, 1, 2, 1, 1]
    machine.per_row = {2: 1.0, 1: 3.0}
    assert machine.step(chooser, rows=40) == 2


def test_one_thread_or_turned_off_makes_no_chooser(monkeypatch: pytest.MonkeyPatch) -> None:
    assert step_threads(1) is None
    assert step_threads(2) is not None
    monkeypatch.setenv("ASYNCENGINE_ADAPTIVE_THREADS", "0")
    assert step_threads(4) is None


@pytest.mark.parametrize("rows", [16, 43, 57])
def test_the_products_are_bit_identical_on_one_thread_and_on_two(rows: int) -> None:
    """SmolLM2's projection shapes and a slice of its head: dense (oneDNN) and F32 rows (the
    native kernel) alike, so switching a step's count never changes a score."""
    torch.manual_seed(rows)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576)]
    before = torch.get_num_threads()
    try:
        for out_features, in_features in shapes:
            linear = make_linear(
                [torch.randn(out_features, in_features) * 0.05], None, torch.float32
            )
            x = torch.randn(rows, in_features)
            products = [linear.dense(torch.float32)]
            if quant_native.available():
                products.append(linear._quantized)  # the F32-rows kernel itself
            for product in products:
                results = []
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    results.append(product(x))
                assert torch.equal(results[0], results[1]), (out_features, in_features)
    finally:
        torch.set_num_threads(before)


def test_on_a_quiet_machine_decode_steps_of_several_rows_and_large_prompt_steps_take_all() -> None:
    """A decode step of several rows that gets its cores, and a long prompt's chunk, are not
    chosen: all threads, every step, even where one thread would be faster (no tries of one
    thread on a quiet machine)."""
    machine = FakeMachine({2: 1.0, 1: 0.5}, cpu_share=0.95)
    chooser = StepThreads(2)
    assert [
        machine.step(chooser, rows=CHOOSE_DECODE_ROWS + 1, prompt_rows=False) for _ in range(40)
    ] == [2] * 40
    assert [machine.step(chooser, rows=512) for _ in range(40)] == [2] * 40
    assert [machine.step(chooser, rows=CHOOSE_BELOW_ROWS) for _ in range(5)] == [2] * 5
    assert chooser.classes == {}  # nothing chosen
    assert not chooser.contended
    assert machine.step(chooser, rows=CHOOSE_BELOW_ROWS - 1) == 1


def test_decode_steps_of_several_rows_choose_while_other_processes_hold_the_cores() -> None:
    """Beside the load, all-thread decode steps get half their cores: they start choosing and
    move to one thread; when the load goes, a try of all threads finds them faster and with
    their cores again, and they stay on all threads without further tries."""
    machine = FakeMachine({2: 3.5, 1: 1.0}, cpu_share=0.5)
    chooser = StepThreads(2)
    rows = 16
    counts = [machine.step(chooser, rows=rows, prompt_rows=False) for _ in range(40)]
    assert chooser.contended and chooser.cpu_share < CONTENDED_SHARE
    assert counts[:2] == [2, 2]  # seen on all threads until the share fell
    assert counts[-20:].count(1) >= 18  # then one thread, but for its tries
    machine.per_row, machine.cpu_share = {2: 1.0, 1: 1.6}, 0.98  # the load goes
    after = [machine.step(chooser, rows=rows, prompt_rows=False) for _ in range(400)]
    assert not chooser.contended
    settled = after.index(2) + 8
    assert after[settled:] == [2] * (len(after) - settled)
    assert chooser.chooses(rows, False) is False  # back to all threads, no tries


def test_large_prompt_steps_choose_too_while_the_cores_are_held() -> None:
    """A long prompt's chunk also runs on one thread once watched steps found the cores held,
    and on all threads again once they are not."""
    machine = FakeMachine({2: 3.0, 1: 1.0}, cpu_share=0.5)
    chooser = StepThreads(2)
    for _ in range(3):
        machine.step(chooser, rows=512)
    assert chooser.contended
    counts = [machine.step(chooser, rows=512) for _ in range(20)]
    assert counts.count(1) >= 18
    machine.per_row, machine.cpu_share = {2: 1.0, 1: 1.6}, 0.98  # the load goes
    chooser.cpu_share = 0.9  # as after a won try of all threads by decode steps
    assert [machine.step(chooser, rows=512) for _ in range(5)] == [2] * 5


def test_one_thread_steps_leave_the_share_alone() -> None:
    """Only all-thread steps tell whether the cores are held: a one-thread step (or a prompt
    step) does not move ``cpu_share``."""
    chooser = StepThreads(2)
    chooser.cpu_share = 0.5
    machine = FakeMachine({2: 3.5, 1: 1.0}, cpu_share=1.0)
    assert machine.step(chooser, rows=16, prompt_rows=False) == 1  # the class's warm-up
    assert machine.step(chooser, rows=40, prompt_rows=True) == 1
    assert chooser.cpu_share == 0.5


def test_one_stream_decodes_choose_apart_from_prompt_steps() -> None:
    """One-row decode steps (one stream: the fused step's 150 barriers a step) are measured as
    a class of their own: under load they move to one thread, quiet they stay on all threads
    after their first tries."""
    loaded = FakeMachine({2: 3.0, 1: 1.0})
    chooser = StepThreads(2)
    counts = [loaded.step(chooser, rows=1, prompt_rows=False) for _ in range(20)]
    assert counts[:3] == [1, 1, 2] and counts[3:18] == [1] * 15  # then a try of two
    assert list(chooser.classes) == [(False, 0)]
    quiet = FakeMachine({2: 1.0, 1: 1.6})
    chooser = StepThreads(2)
    counts = [quiet.step(chooser, rows=1, prompt_rows=False) for _ in range(300)]
    assert counts[:3] == [1, 1, 2]
    assert counts[3:].count(1) <= 5  # the tries, ever rarer


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch on two threads (the process's count a chooser starts from), set back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _on_one_thread_and_on_two(step: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """``step()`` on one thread and on two, its work planned for two (as a chosen step's is)."""
    results = []
    with planning_for(2):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(step())
    return results


# keys of one row where split-K cuts 4 ranges for one thread and 8 for two (cpu_split_k.h)
LONG_KEYS = 2100


@needs_native
def test_a_long_one_row_decode_is_bit_identical_on_one_thread_and_on_two(
    tiny_llama: TinyCheckpoint, two_threads: None
) -> None:
    """The fused step's split-K attention: its key ranges are planned for the process's count,
    so a team of one sums the same ranges in the same order."""
    row = long_row(tiny_llama, LONG_KEYS)
    row.model.bind_caches(row.k, row.v)  # the step rewrites its own key's slot with the same values
    lens = torch.tensor([LONG_KEYS], dtype=torch.int32)

    def step() -> torch.Tensor:
        slots = torch.tensor([row.slot])
        return row.model.step(row.hidden, torch.tensor([100]), slots, row.table, lens, 16)

    one, two = _on_one_thread_and_on_two(step)
    assert torch.isfinite(one).all()
    assert torch.equal(one, two)


@needs_native
def test_the_paged_decode_kernel_is_bit_identical_on_one_thread_and_on_two(
    two_threads: None,
) -> None:
    """The layer-by-layer path's decode attention (cpu_decode_attention.c), split-K alike:
    SmolLM2's heads (9 query, 3 kv, 64 wide) over one long row."""
    gen = torch.Generator().manual_seed(7)
    page_size, pages = 16, -(-LONG_KEYS // 16)
    k_cache = torch.randn(pages * page_size, 3, 64, generator=gen)
    v_cache = torch.randn(pages * page_size, 3, 64, generator=gen)
    q = torch.randn(1, 9, 64, generator=gen)
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(1, pages)
    plan = plan_native_decode(table, torch.tensor([LONG_KEYS]), page_size, 9, k_cache)
    assert plan is not None
    one, two = _on_one_thread_and_on_two(
        lambda: native_decode_attention(q, k_cache, v_cache, plan, 0.125)
    )
    assert torch.equal(one, two)


@needs_native
def test_a_decode_step_with_lora_rows_is_bit_identical_on_one_thread_and_on_two(
    tiny_llama: TinyCheckpoint, tmp_path: Path, two_threads: None
) -> None:
    """The fused step's LoRA shrinks, split over the team by input: a team of one sums the
    parts of the shares a team of two would, in their order."""
    h = _harness(tiny_llama, write_adapters(tiny_llama.path, tmp_path))
    assert h.runner.model.native_decode is not None
    prefill = [
        Segment(f"r{row}", row, prompt, 0, True, lora=lora)
        for row, (lora, prompt) in enumerate(REQUESTS)
    ]
    firsts = h.runner.forward_logits(
        BatchPlan(step=0, extends=prefill, sampling=_greedy(len(REQUESTS)))
    ).argmax(-1)
    decodes = [
        Segment(f"r{row}", row, [int(firsts[row])], len(prompt), True, lora=lora)
        for row, (lora, prompt) in enumerate(REQUESTS)
    ]
    plan = BatchPlan(step=1, decodes=decodes, sampling=_greedy(len(REQUESTS)))
    one, two = _on_one_thread_and_on_two(lambda: h.runner.forward_logits(plan))
    assert torch.equal(one, two)


def test_a_chosen_step_plans_the_kernels_for_the_process_count(
    tiny_llama: TinyCheckpoint, two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's steps on one thread still plan the kernels' pieces for two."""
    runner = Harness(tiny_llama, page_size=4).runner
    runner.step_threads = StepThreads(2)
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(
        runner, "_execute", lambda plan: seen.append((torch.get_num_threads(), plan_threads()))
    )
    runner.execute(BatchPlan(step=0))  # a class's first step: on one thread
    assert seen == [(1, 2)]
    assert plan_threads() == torch.get_num_threads() == 2  # outside a step: torch's count
