"""lpm: longest cached prefix first, with aging so a cache miss cannot wait forever."""

from __future__ import annotations

from typing import Any

from asyncengine.request import Request
from policies.base import Policy, PolicyContext, take_options


class LPMPolicy(Policy):
    """Priority = cached prefix tokens + ``aging_tokens_per_second`` * seconds waited.

    A request that has waited ``max_wait_seconds`` goes before every younger one, whatever
    its match: the aging term makes that rare, the cap makes it certain.
    """

    name = "lpm"
    orders = True

    def __init__(self, **options: Any) -> None:
        opts = take_options(
            self.name, options, {"aging_tokens_per_second": 256.0, "max_wait_seconds": 30.0}
        )
        self.aging = opts["aging_tokens_per_second"]
        self.max_wait = opts["max_wait_seconds"]

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        def key(req: Request) -> tuple[bool, float, float]:
            waited = ctx.now - req.arrival_time
            starving = waited >= self.max_wait
            score = ctx.prefix_len(req.all_ids) + self.aging * waited
            return (not starving, -score, req.arrival_time)

        return sorted(waiting, key=key)
