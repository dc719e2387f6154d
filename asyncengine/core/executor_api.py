"""What the engine core needs from an executor, and what it tells it (no torch).

An executor runs plans: the real model (asyncengine/executor/model_executor.py), a cost model
on a virtual clock (asyncengine/sim/simulated_executor.py), a timer around another executor
(asyncengine/sim/timed_executor.py), or a model-free fake in the tests. ``build_core`` asks the
executor for its ``spec``, sizes the KV memory, tells the executor the resulting ``KVLayout``
with ``bind``, and from then on the core only calls ``execute``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from asyncengine.common.config import EngineConfig
    from asyncengine.common.plan import BatchPlan, StepOutput


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The facts about the model that scheduling and KV sizing depend on."""

    max_model_len: int  # the model's own context limit
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_bytes_per_token: int  # K and V of one token across all layers
    pooling: str = "mean"  # how an embedding request is pooled: "mean" | "last" (pooling.py)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV memory the core manages: the executor allocates a pool and a table to match."""

    num_pages: int
    page_size: int
    max_rows: int  # page-table rows: live requests at most
    max_pages_per_row: int
    swap_pages: int = 0  # pages of the host buffer for swapped-out KV (preemption_mode "swap")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size


class Executor(Protocol):
    @property
    def spec(self) -> ModelSpec: ...

    def kv_budget_bytes(self, config: EngineConfig) -> int | None:
        """Bytes for the KV pool when the config sets no size (None: the default token count)."""
        ...

    def bind(self, layout: KVLayout) -> None:
        """Allocate the KV pool and page table for ``layout``; called once, before execute."""
        ...

    def execute(self, plan: BatchPlan) -> StepOutput:
        """Apply the plan's page writes, run it, and return one token per sampled segment."""
        ...


def defers_inputs(executor: object) -> bool:
    """Whether ``executor`` fills in a plan's deferred decode inputs (``BatchPlan.deferred``)
    from the tokens it sampled last, so that a plan can be made before the previous one lands
    (overlap scheduling: scheduler/plan_ahead.py). An executor says so with a true
    ``defers_inputs`` attribute."""
    return bool(getattr(executor, "defers_inputs", False))


def defer_one_time_work(executor: object) -> Callable[[], bool] | None:
    """Work the executor would otherwise do in its first steps (the real model's huge pages and
    int8 panels), left for the engine to run between steps: the function that does a piece of
    it, on the thread that runs ``execute``, True while more remains; None where the executor
    defers none (it says so with a ``defer_one_time_work`` method)."""
    defer = getattr(executor, "defer_one_time_work", None)
    if defer is None:
        return None
    work: Callable[[], bool] | None = defer()
    return work
