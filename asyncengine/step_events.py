"""What a step did to requests, as plain data: the tokens it sampled and every request that ended.

``EngineCore.land`` returns a ``StepEvents`` per step (``EngineCore.events`` one for what ended
between steps: an abort, a timeout decided while nothing ran); drivers read it, and the async
engine turns it into stream updates. Every ending is decided by the lifecycle (lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.plan import BatchPlan, TokenLogprobs
from asyncengine.request import Request


@dataclass(slots=True)
class TokenEvent:
    """One sampled token for one request, and whether that token finished it. A verified row
    (speculative decoding) gives several events in one step, in order; ``output_len`` is the
    request's output length with this token (the lifecycle drops the tokens after an end)."""

    req: Request
    token_id: int
    logprobs: TokenLogprobs | None
    output_len: int
    finished: bool = False


@dataclass(slots=True)
class StepEvents:
    """One step's events (``plan`` None: the endings decided between steps).

    ``ended`` lists every request that ended since the previous report, whatever the reason
    (stop, length, timeout, abort, a failed forward, a fork whose leader ended before it
    prefilled); ``failed`` the ones among them whose forward raised ``error``; ``released`` the
    n > 1 choices handed to the scheduler because their leader's prompt is cached now.
    """

    plan: BatchPlan | None = None
    tokens: list[TokenEvent] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    released: list[Request] = field(default_factory=list)
    error: BaseException | None = None
    forward_seconds: float = 0.0

    @property
    def expired(self) -> list[Request]:
        """The requests that ran out of time (reason "timeout")."""
        return [req for req in self.ended if req.finish_reason == "timeout"]
