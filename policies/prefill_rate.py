"""PrefillRate: the engine's measured prefill speed, in prompt tokens per second of step time.

Fed by ``Policy.observe`` with every finished step. Only steps that carry prefill tokens count
(their whole forward time, decodes riding along included), and older steps fade out with
``decay`` per counted step, so the rate follows the machine's current load. Policies use it to
turn seconds into machine-independent amounts of work: a second waited on a machine that
prefills 20,000 tokens per second is worth as much as 20 seconds on one that prefills 1,000.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncengine.common.plan import BatchPlan


@dataclass(slots=True)
class PrefillRate:
    decay: float = 0.99
    tokens: float = 0.0  # decayed sum of prefill tokens of the counted steps
    seconds: float = 0.0  # decayed sum of their forward seconds

    def add(self, plan: BatchPlan, seconds: float) -> None:
        tokens = 0
        for segment in plan.extends:
            tokens += len(segment.input_ids)
        if tokens == 0 or seconds <= 0:
            return
        self.tokens = self.tokens * self.decay + tokens
        self.seconds = self.seconds * self.decay + seconds

    @property
    def tokens_per_second(self) -> float:
        """0.0 until a prefill step has been seen."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
