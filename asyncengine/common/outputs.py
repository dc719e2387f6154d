"""What the engine hands back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.common.plan import TokenLogprobs


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    accepted_speculative_tokens: int = 0  # output tokens that were accepted guesses

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestMetrics:
    """Seconds. ``queue_time``: arrival to first scheduled; ``ttft``: arrival to first token.

    ``cached_tokens``: prompt tokens served from the prefix cache (as ``Usage.cached_tokens``).
    ``blocked``: steps the request waited, by the reason admission stopped short of it
    (asyncengine/scheduler/admission.py).
    """

    arrival_time: float
    queue_time: float | None
    ttft: float | None
    e2e: float
    itl: list[float] = field(default_factory=list)
    retractions: int = 0
    cached_tokens: int = 0
    tenant: str | None = None
    priority: int = 0
    blocked: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class StreamDelta:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    usage: Usage | None = None
    metrics: RequestMetrics | None = None
    index: int = 0  # which choice of an n > 1 request
    embedding: list[float] | None = None  # an embedding request's vector, on its final delta
    # prompt tokens read from the prefix cache (as Usage's), fixed at the request's first
    # scheduling: a stream's header can show the split of its prompt before the usage comes
    cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt token (None: not scored), in the
    # choice's first delta
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class GenerateOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    metrics: RequestMetrics
    matched_stop: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # which choice of an n > 1 request
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # as StreamDelta's


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (``AsyncEngine.embed``): unit length, pooled as the model says."""

    request_id: str
    embedding: list[float]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens taken from the prefix cache (last-token pooling only)
    metrics: RequestMetrics
