"""A model-free executor for the engine core's tests.

It keeps a token id and a position in every KV slot, writes each segment's tokens through its
own page table (kept only from the plans' page writes, as the real runner keeps its table)
exactly as the real runner writes K/V, and reads a request's whole context back from its pages
before "sampling". The sampled token is a hash of that context, so a wrong slot, a wrong page,
a missing page write, a stale shared prefix or a wrong position changes the output, and the
outputs can be compared with ``reference_output`` computed without any batching or caching.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from asyncengine.cache.page_table import PageTable
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, Segment, StepOutput
from asyncengine.core.builder import build_core
from asyncengine.core.engine_core import EngineCore
from asyncengine.core.executor_api import KVLayout, ModelSpec
from asyncengine.speculative.acceptance import accepted_prefix

VOCAB = 1000
EOS = 0


def next_token(context: list[int] | np.ndarray) -> int:
    ids = np.asarray(context, dtype=np.int64)
    weights = np.arange(1, ids.size + 1, dtype=np.int64) * 7919 + 13
    token = int(((ids + 1) * weights).sum() % 999_983) % (VOCAB - 1) + 1
    return token  # never EOS: requests stop by length unless a test says otherwise


def fake_hidden(context: list[int] | np.ndarray) -> list[float]:
    """The fake model's final hidden state after ``context``: two numbers that depend on every
    token and the position."""
    return [float(next_token(context)), float(len(context) % 7 + 1)]


def reference_embedding(prompt: list[int], pooling: str) -> list[float]:
    """``prompt``'s embedding from the fake model, computed without KV, chunks or cache."""
    rows = [fake_hidden(prompt[: p + 1]) for p in range(len(prompt))]
    if pooling == "last":
        rows = rows[-1:]
    mean = [sum(column) / len(rows) for column in zip(*rows, strict=True)]
    norm = sum(x * x for x in mean) ** 0.5
    return [x / norm for x in mean]


def reference_output(prompt: list[int], max_new_tokens: int) -> list[int]:
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = next_token(seq)
        out.append(token)
        seq.append(token)
    return out


class FakeExecutor:
    def __init__(self, max_model_len: int = 4096, pooling: str = "mean") -> None:
        self.spec = ModelSpec(
            max_model_len=max_model_len,
            vocab_size=VOCAB,
            eos_token_ids=(EOS,),
            kv_bytes_per_token=1,
            pooling=pooling,
        )
        self.steps = 0
        self.fail_on_step: int | None = None
        # a test turns it on: plans made ahead (BatchPlan.deferred) take a decode's input
        # token from the token last sampled for its row, as a GPU executor keeps it
        self.defers_inputs = False
        self.last_sampled: dict[int, int] = {}  # page-table row -> its last sampled token

    def kv_budget_bytes(self, config: EngineConfig) -> int | None:
        return None

    def bind(self, layout: KVLayout) -> None:
        self.page_size = layout.page_size
        self.table = PageTable(layout.max_rows, layout.max_pages_per_row)
        self.token_at = np.full(layout.num_slots, -1, dtype=np.int64)
        self.pos_at = np.full(layout.num_slots, -1, dtype=np.int64)
        host_slots = layout.swap_pages * layout.page_size  # the swap buffer, as the pool
        self.host_token_at = np.full(host_slots, -1, dtype=np.int64)
        self.host_pos_at = np.full(host_slots, -1, dtype=np.int64)

    def _page_slots(self, pages: list[int]) -> np.ndarray:
        ps = self.page_size
        return (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).ravel()

    def _swap(self, plan: BatchPlan) -> None:
        """Copy whole pages out to the host buffer, then back in, as the real executor does."""
        for copy in plan.swap_out:
            src, dst = self._page_slots(copy.pool_pages), self._page_slots(copy.host_pages)
            self.host_token_at[dst] = self.token_at[src]
            self.host_pos_at[dst] = self.pos_at[src]
        for copy in plan.swap_in:
            src, dst = self._page_slots(copy.host_pages), self._page_slots(copy.pool_pages)
            self.token_at[dst] = self.host_token_at[src]
            self.pos_at[dst] = self.host_pos_at[src]

    def _slots(self, row: int, start: int, end: int) -> np.ndarray:
        ps = self.page_size
        pages = self.table.row_pages(row, -(-end // ps)).astype(np.int64)
        positions = np.arange(start, end)
        return pages[positions // ps] * ps + positions % ps

    def execute(self, plan: BatchPlan) -> StepOutput:
        self.steps += 1
        if self.fail_on_step is not None and self.steps == self.fail_on_step:
            raise RuntimeError("injected forward failure")
        self._swap(plan)
        for src, dst in plan.page_copies:  # kept tail pages, copied on write as KVPool does
            src_slots, dst_slots = self._page_slots([src]), self._page_slots([dst])
            self.token_at[dst_slots] = self.token_at[src_slots]
            self.pos_at[dst_slots] = self.pos_at[src_slots]
        self.table.apply(plan.page_writes)
        tokens: list[int] = []
        deferred = {id(plan.decodes[i]) for i in plan.deferred}
        if deferred and not self.defers_inputs:
            raise AssertionError(f"plan {plan.step} defers inputs to an executor that does not")
        for seg in plan.segments:
            slots = self._slots(seg.row, seg.start_pos, seg.end_pos)
            if id(seg) in deferred:
                assert seg.input_ids == [-1], f"{seg.rid}: a deferred input carries a token"
                self.token_at[slots] = [self.last_sampled[seg.row]]
            else:
                self.token_at[slots] = seg.input_ids
            self.pos_at[slots] = np.arange(seg.start_pos, seg.end_pos)
        if plan.kv_copies:  # positions shared in the step, copied as each layer does
            src, dst = np.asarray(plan.kv_copies, dtype=np.int64).T
            self.token_at[dst] = self.token_at[src]
            self.pos_at[dst] = self.pos_at[src]
        accepted: list[int] = []
        for seg in plan.segments:
            if not seg.sample:
                continue
            slots = self._slots(seg.row, 0, seg.end_pos)
            assert (self.pos_at[slots] == np.arange(seg.end_pos)).all(), (
                f"{seg.rid}: positions in KV are wrong"
            )
            # a verified row: the token after each of its last guesses + 1 positions
            ends = range(seg.end_pos - seg.guesses, seg.end_pos + 1)
            sampled = [next_token(self.token_at[slots[:end]]) for end in ends]
            kept = accepted_prefix(seg.input_ids[seg.num_tokens - seg.guesses :], sampled)
            tokens.append(sampled[kept])
            accepted.append(kept)
            self.last_sampled[seg.row] = sampled[kept]
        pooled = [self._pooled(seg) for seg in plan.extends if seg.pool is not None]
        return StepOutput(
            tokens,
            [None] * len(tokens),
            forward_seconds=1e-3 * plan.num_tokens,
            accepted=accepted if plan.num_guesses else [],
            pooled=pooled,
        )

    def _pooled(self, seg: Segment) -> list[float]:
        """A pooled segment's part: the "hidden state" at position p is ``fake_hidden`` of the
        context read back from KV, summed over the segment's rows ("sum") or its last row."""
        first = seg.start_pos if seg.pool == "sum" else seg.end_pos - 1
        slots = self._slots(seg.row, 0, seg.end_pos)
        context = self.token_at[slots]
        rows = [fake_hidden(context[: p + 1]) for p in range(first, seg.end_pos)]
        return [float(sum(column)) for column in zip(*rows, strict=True)]


def fake_core(
    num_pages: int = 256,
    page_size: int = 4,
    max_model_len: int = 4096,
    clock: Callable[[], float] | None = None,
    **overrides: object,
) -> tuple[EngineCore, FakeExecutor]:
    """An engine core over a FakeExecutor: ``num_pages`` pages of ``page_size`` tokens."""
    values: dict[str, object] = {
        "page_size": page_size,
        "kv_cache_tokens": num_pages * page_size,
        "log_interval": 0,
        **overrides,
    }
    config = EngineConfig.from_dict(values)
    executor = FakeExecutor(max_model_len)
    core = build_core(config, executor) if clock is None else build_core(config, executor, clock)
    return core, executor


class StopStringAt:
    """A request's output text that "completes" the stop string ``"END"`` at its k-th token
    (if the request may stop by then)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.seen = 0

    def push(self, token_id: int, may_stop: bool = True) -> str | None:
        self.seen += 1
        return "END" if self.seen == self.k and may_stop else None
