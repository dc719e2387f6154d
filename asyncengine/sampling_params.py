"""Per-request sampling parameters and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_PRIORITY = 2**31 - 1
MAX_TENANT_LENGTH = 256


class InvalidRequestError(ValueError):
    """A request the engine refuses before queueing it (bad parameter, prompt too long, ...)."""


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes sampled output reproducible whatever else shares the batch.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    # scheduling controls (read by the scheduler and policies, not by the sampler)
    priority: int = 0  # lower values are served first by the "priority" policy (vLLM's sense)
    timeout: float | None = None  # seconds from arrival; then it ends with reason "timeout"
    tenant: str | None = None  # who the request belongs to ("fair" policy, per-tenant metrics)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(
                f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}"
            )

        for name in ("max_new_tokens", "top_k", "min_new_tokens", "top_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, "must be an integer")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise bad(name, "must be a finite number")
        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be >= 1")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", "must be between 0 and max_new_tokens")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 10:
            raise bad("repetition_penalty", "must be in (0, 10]")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise bad("seed", "must be an integer or None")
        if not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", "must be in [0, 20]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            raise bad("stop", "at most 16 stop strings")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise bad("priority", "must be an integer")
        if abs(self.priority) > MAX_PRIORITY:
            raise bad("priority", f"must be between -{MAX_PRIORITY} and {MAX_PRIORITY}")
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not math.isfinite(self.timeout)
            or self.timeout <= 0
        ):
            raise bad("timeout", "must be a positive number of seconds or None")
        if self.tenant is not None and (
            not isinstance(self.tenant, str) or not 0 < len(self.tenant) <= MAX_TENANT_LENGTH
        ):
            raise bad("tenant", f"must be a string of 1 to {MAX_TENANT_LENGTH} characters or None")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
