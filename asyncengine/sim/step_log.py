"""A step hook that keeps what each landed step ran, to explain one request's wait afterwards.

``EngineCore.step_hooks`` calls it after every landed step; it keeps, per step, when it landed
on the driver's clock, its prefill segments and its decode count, the queue behind it and the
adapters it held. ``first_extend(rid)`` is then the step that first computed a request's
prompt: the batch it was admitted into. A few numbers per step, so a run of minutes keeps
some megabytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from asyncengine.common.plan import BatchPlan


class _Queues(Protocol):
    waiting: Any  # a WaitingQueue (sized)
    running: Any  # the running requests (sized)


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    landed: float  # when it landed, on the log's clock (seconds)
    seconds: float  # since the previous step landed (its forward when steps run back to back)
    extends: tuple[tuple[str, int], ...]  # (rid, prompt tokens computed) per prefill segment
    decodes: int
    adapters: int  # distinct LoRA adapters in the step
    waiting: int  # requests waiting after the step was planned
    running: int  # requests decoding after it landed

    def batch(self) -> dict[str, Any]:
        """The step as a request's admission batch (JSON-ready)."""
        return {
            "step": self.step,
            "landed": round(self.landed, 4),
            "seconds": round(self.seconds, 4),
            "prefills": len(self.extends),
            "prefill_tokens": sum(tokens for _, tokens in self.extends),
            "decodes": self.decodes,
            "adapters": self.adapters,
            "waiting": self.waiting,
            "running": self.running,
        }


class StepLog:
    """The hook: ``attach(scheduler, clock)`` first, then append it to the core's
    ``step_hooks``."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self._first_extend: dict[str, int] = {}  # rid -> index in ``steps``
        self._queues: _Queues | None = None
        self._clock: Callable[[], float] = lambda: 0.0

    def attach(self, queues: _Queues, clock: Callable[[], float]) -> None:
        """Read ``queues`` (the scheduler) at each step, and the time from ``clock``."""
        self._queues, self._clock = queues, clock

    def __call__(self, plan: BatchPlan) -> None:
        landed = self._clock()
        previous = self.steps[-1].landed if self.steps else landed
        extends = tuple((seg.rid, len(seg.input_ids)) for seg in plan.extends)
        index = len(self.steps)
        for rid, _ in extends:
            self._first_extend.setdefault(rid, index)
        adapters = {seg.lora for seg in plan.segments if seg.lora is not None}
        queues = self._queues
        self.steps.append(
            StepRecord(
                plan.step,
                landed,
                landed - previous,
                extends,
                len(plan.decodes),
                len(adapters),
                len(queues.waiting) if queues is not None else 0,
                len(queues.running) if queues is not None else 0,
            )
        )

    def first_extend(self, rid: str) -> StepRecord | None:
        """The step that first computed ``rid``'s prompt (None: none logged did)."""
        index = self._first_extend.get(rid)
        return None if index is None else self.steps[index]
