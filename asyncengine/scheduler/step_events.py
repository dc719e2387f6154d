"""What a step did to requests, as plain data: the tokens it sampled and every request that ended.

``EngineCore.land`` returns a ``StepEvents`` per step (``EngineCore.events`` one for what ended
between steps: an abort, a timeout decided while nothing ran); drivers read it, and the async
engine turns it into stream updates. Every ending is decided by the lifecycle (lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.common.plan import BatchPlan, TokenLogprobs
from asyncengine.common.request import Request


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

    # Written out because mypyc compiles this class (one per sampled token) and leaves a
    # dataclass-made __init__ interpreted; tests/test_compiled.py checks it against the fields.
    def __init__(
        self,
        req: Request,
        token_id: int,
        logprobs: TokenLogprobs | None,
        output_len: int,
        finished: bool = False,
    ) -> None:
        self.req = req
        self.token_id = token_id
        self.logprobs = logprobs
        self.output_len = output_len
        self.finished = finished


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

    # Written out because mypyc compiles this class (every step makes one) and leaves a
    # dataclass-made __init__ interpreted; tests/test_compiled.py checks it against the fields.
    def __init__(
        self,
        plan: BatchPlan | None = None,
        tokens: list[TokenEvent] | None = None,
        ended: list[Request] | None = None,
        failed: list[Request] | None = None,
        released: list[Request] | None = None,
        error: BaseException | None = None,
        forward_seconds: float = 0.0,
    ) -> None:
        self.plan = plan
        self.tokens = [] if tokens is None else tokens
        self.ended = [] if ended is None else ended
        self.failed = [] if failed is None else failed
        self.released = [] if released is None else released
        self.error = error
        self.forward_seconds = forward_seconds

    @property
    def expired(self) -> list[Request]:
        """The requests that ran out of time (reason "timeout")."""
        return [req for req in self.ended if req.finish_reason == "timeout"]
