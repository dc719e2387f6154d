"""lpm: longest cached prefix first, with aging so a cache miss cannot wait forever.

Waiting time is measured in work, not seconds: a request's wait counts as the prompt tokens
the engine prefills in that time (seconds waited x the measured prefill rate, see
``PrefillRate``). So the balance between a cache hit and a long wait is the same on a CPU that
prefills 1,000 tokens per second and on a GPU that prefills 50,000: queue waits scale with the
machine's speed, and so does the rate.

LoRA affinity: a request whose adapter the step already holds (``PolicyContext.step_loras``)
counts ``lora_affinity`` tokens more, as if that much more of it were cached: it joins without
taking one of ``max_loras`` slots, and the batch's LoRA rows share fewer adapters. The bonus is
bounded, so a request of another adapter that waited ``lora_affinity / aging`` tokens' worth
of prefill overtakes it, and the ``max_wait_tokens`` cap puts the starving first whatever
their adapter (admission then keeps a slot for an adapter that waits for one: lora_slots.py).
"""

from __future__ import annotations

import math
from typing import Any

from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext, take_options
from asyncengine.policies.prefill_rate import PrefillRate


class LPMPolicy(Policy):
    """Priority = cached prefix tokens + ``aging`` x (tokens prefilled in the time waited).

    A request that has waited as long as the engine takes to prefill ``max_wait_tokens``
    tokens goes before every younger one, whatever its match: the aging term makes that rare,
    the cap makes it certain. Until a prefill step has been observed the rate is unknown and
    the order is by cached prefix alone. A request whose LoRA adapter is in the step adds
    ``lora_affinity`` to its priority.
    """

    name = "lpm"
    orders = True
    sees_decodes = False  # its PrefillRate counts prefill steps only

    def __init__(self, **options: Any) -> None:
        opts = take_options(
            self.name,
            options,
            {"aging": 0.01, "max_wait_tokens": 1_000_000, "lora_affinity": 256.0},
        )
        if opts["aging"] < 0 or opts["max_wait_tokens"] < 1 or opts["lora_affinity"] < 0:
            raise ValueError(
                "policy 'lpm': 'aging' and 'lora_affinity' must be >= 0 and 'max_wait_tokens' >= 1"
            )
        self.lora_affinity = float(opts["lora_affinity"])
        self.aging = opts["aging"]
        self.max_wait_tokens = opts["max_wait_tokens"]
        self.prefill_rate = PrefillRate()
        # id(request) -> (its prefix epoch, its token count) when its cached prefix was 0: most
        # of a long queue matches nothing, and that holds until a prefix it could match is cached
        self._unmatched: dict[int, tuple[int, int]] = {}
        # the last window in which nothing matched, the cache epoch then and its order: the
        # same window with nothing cached since matches nothing still, so it gets that order
        self._all_miss: tuple[list[Request], int, list[Request]] | None = None

    def observe(self, plan: BatchPlan, seconds: float) -> None:
        self.prefill_rate.add(plan, seconds)

    def finished(self, req: Request) -> None:
        self._unmatched.pop(id(req), None)

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        if len(waiting) < 2:
            return waiting
        rate = self.prefill_rate.tokens_per_second
        aging = self.aging * rate  # priority tokens per second waited
        cap = self.max_wait_tokens
        now = ctx.now
        epoch_of, cache_epoch = ctx.prefix_epoch, ctx.cache_epoch
        # requests whose adapter the step holds (the bonus goes to those only)
        boosted = self._in_step_adapters(waiting, ctx)
        last = self._all_miss
        if (
            not boosted
            and last is not None
            and cache_epoch == last[1]
            and epoch_of is not None
            and math.isfinite(aging)
            and waiting == last[0]  # the same requests in the same places
        ):
            return list(last[2])
        cached_of = ctx.cached_prefix  # kept per waiting request: no walk while unchanged
        unmatched = self._unmatched
        # each one's cached prefix first: on a long queue of misses all are 0 (most skip the
        # tree walk by the memo), and then the order is known without scoring anyone
        matches: list[int] = []
        any_cached = False
        for req in waiting:
            ids = req.cache_ids
            stamp = None if epoch_of is None else (epoch_of(ids), len(ids))
            if stamp is not None and unmatched.get(id(req)) == stamp:
                matches.append(0)
                continue
            cached = cached_of(req)
            if stamp is not None and not cached:
                unmatched[id(req)] = stamp
            matches.append(cached)
            any_cached = any_cached or cached > 0
        if not any_cached and not boosted and math.isfinite(aging):
            # every score is -(aging x waited), which never decreases with the wait, and the
            # starving are the longest waiting: the keys below sort exactly by arrival, then
            # place (a stable sort by arrival)
            ordered = sorted(waiting, key=_arrival)
            if cache_epoch is not None and epoch_of is not None:
                self._all_miss = (list(waiting), cache_epoch, list(ordered))
            return ordered
        affinity = self.lora_affinity
        keyed: list[tuple[bool, float, float, int]] = []
        for index, req in enumerate(waiting):
            arrival = req.arrival_time
            waited = now - arrival
            starving = waited * rate >= cap
            # the starving go first, oldest first (a cached prefix must not keep one waiting)
            bonus = affinity if boosted and id(req) in boosted else 0.0
            score = 0.0 if starving else -(matches[index] + bonus + aging * waited)
            keyed.append((not starving, score, arrival, index))
        keyed.sort()
        return [waiting[item[3]] for item in keyed]

    def _in_step_adapters(self, waiting: list[Request], ctx: PolicyContext) -> set[int]:
        """ids of the waiting requests whose LoRA adapter the step already holds."""
        if not self.lora_affinity:
            return set()
        in_step = ctx.step_loras()
        if not in_step:
            return set()
        return {id(req) for req in waiting if req.params.lora in in_step}


def _arrival(req: Request) -> float:
    return req.arrival_time
