"""fair: virtual token counters across tenants (VTC, Sheng et al., OSDI 2024).

Each tenant (``SamplingParams.tenant``; requests without one share the tenant "") has a counter
of the service it received: ``prefill_weight`` per prompt token computed plus ``decode_weight``
per token generated, divided by the tenant's weight (``weights`` maps tenant to weight,
``default_weight`` for the rest). The waiting queue is ordered by serving the tenant with the
smallest counter first, each tenant's requests in arrival order; while ordering, each pick
charges its tenant the pick's prompt tokens, so one step's admissions interleave tenants
instead of handing them all to one. Counters charge what the engine actually ran (``observe``).

``policy_window`` applies per tenant (``candidates``): the policy orders each tenant's oldest
``policy_window`` waiting requests, so a backlog deeper than the window, all of one heavy
tenant's, hides no other tenant's requests from it (VTC needs to see every backlogged
client's queue to serve the one with the least service as much as it can take).

With ``preempt = true`` a waiting request that the running-request cap or KV memory blocks
may have running requests of clients whose counter is more than ``preempt_margin`` above its
client's retracted for it, the most served client's first (their computed prefix stays
cached, and they never emit a token twice): a flood that fills the running batch then cannot
make an under-served client wait for its requests to finish. The margin keeps two clients
served alike from trading places step by step, but a client coming back from idle starts at
the flood's counter (below), so by counters alone it would wait for the flood to be served
``preempt_margin`` more. So it may also take its share of the running batch
(``preempt_for_share``, on by default). A client's share is ``max_running_requests`` split
among the clients with requests in the engine by weight; one running fewer requests than its
share may have running requests retracted of a client over its share that is served no less
(the least computed first), as many as leave that one at its share and at least as many as
it has, never more: the one that gives them up cannot take them back by the same rule, never
leaves the batch by it, and clients at or under their share are never touched by it.

A tenant that comes back after having nothing in the engine starts from the smallest counter
of the tenants that are active, never below its own: it cannot bank service it did not use
while idle, and it is not punished for service it got long ago.

Tenant names come from clients (the ``user`` field), so the state of idle tenants is bounded:
past ``max_idle_tenants`` the least recently active idle tenant is forgotten. One that comes
back then starts as a new tenant does, from the active floor; by the rule above that is where
it would start anyway unless it had got more than the active tenants, which it had not been
competing for while idle.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext, take_options


def tenant_of(req: Request) -> str:
    return req.params.tenant or ""


def _least_computed(req: Request) -> tuple[int, float, str]:
    """Sort key: the fewest tokens generated first, then the newest."""
    return (len(req.output_ids), -req.arrival_time, req.rid)


class FairPolicy(Policy):
    name = "fair"
    orders = True
    preempt_by_default = False  # the ``preempt`` option's default

    def __init__(self, **options: Any) -> None:
        opts = take_options(
            self.name,
            options,
            {
                "weights": {},
                "default_weight": 1.0,
                "prefill_weight": 1.0,
                "decode_weight": 2.0,
                "max_idle_tenants": 4096,
                "preempt": self.preempt_by_default,
                "preempt_margin": 1024.0,
                "preempt_for_share": True,
            },
        )
        weights = {str(k): v for k, v in opts["weights"].items()}
        for tenant, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
                raise ValueError(f"policy {self.name!r}: weight of tenant {tenant!r} must be > 0")
        if opts["default_weight"] <= 0:
            raise ValueError(f"policy {self.name!r}: 'default_weight' must be > 0")
        if opts["prefill_weight"] < 0 or opts["decode_weight"] < 0:
            raise ValueError(f"policy {self.name!r}: token weights must be >= 0")
        if opts["preempt_margin"] < 0:
            raise ValueError(f"policy {self.name!r}: 'preempt_margin' must be >= 0")
        if opts["max_idle_tenants"] < 0:
            raise ValueError(f"policy {self.name!r}: 'max_idle_tenants' must be >= 0")
        self.weights = {tenant: float(weight) for tenant, weight in weights.items()}
        self.default_weight = float(opts["default_weight"])
        self.prefill_weight = float(opts["prefill_weight"])
        self.decode_weight = float(opts["decode_weight"])
        self.preempts = bool(opts["preempt"])
        self.preempt_margin = float(opts["preempt_margin"])
        self.preempt_for_share = bool(opts["preempt_for_share"])
        self.counters: dict[str, float] = {}
        self._tenant_of_rid: dict[str, str] = {}  # live requests this policy has seen
        self._live: dict[str, int] = {}  # tenant -> live requests seen
        self.max_idle_tenants = int(opts["max_idle_tenants"])
        # tenants with no live request, least recently active first (forgotten past the cap)
        self._idle: OrderedDict[str, None] = OrderedDict()

    def group_of(self, req: Request) -> str:
        """The client whose counter ``req`` is charged to: its tenant here (``lora-fair``:
        its adapter)."""
        return tenant_of(req)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def _register(self, req: Request) -> None:
        """First sight of a live request: a tenant coming back is lifted to the active floor."""
        tenant = self.group_of(req)
        self._tenant_of_rid[req.rid] = tenant
        self._idle.pop(tenant, None)
        if self._live.get(tenant, 0) == 0:
            active = [self.counters.get(t, 0.0) for t, n in self._live.items() if n > 0]
            floor = min(active) if active else self.counters.get(tenant, 0.0)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self._live[tenant] = self._live.get(tenant, 0) + 1

    def finished(self, req: Request) -> None:
        tenant = self._tenant_of_rid.pop(req.rid, None)
        if tenant is None:
            return
        self._live[tenant] -= 1
        if self._live[tenant] == 0:
            self._idle[tenant] = None
            while len(self._idle) > self.max_idle_tenants:
                gone, _ = self._idle.popitem(last=False)
                del self._live[gone]
                self.counters.pop(gone, None)

    def observe(self, plan: BatchPlan, seconds: float) -> None:
        tenants, counters = self._tenant_of_rid, self.counters
        for seg in plan.extends:
            tenant = tenants.get(seg.rid)
            if tenant is not None:
                charge = self.prefill_weight * seg.num_tokens / self.weight(tenant)
                counters[tenant] = counters.get(tenant, 0.0) + charge
        for seg in plan.decodes:
            tenant = tenants.get(seg.rid)
            if tenant is not None:
                counters[tenant] = counters.get(tenant, 0.0) + self.decode_weight / self.weight(
                    tenant
                )

    def preempt_candidates(
        self, candidate: Request | None, running: Sequence[Request], ctx: PolicyContext
    ) -> list[Request]:
        if candidate is None:  # KV shortage: the config's preemption_victim
            return super().preempt_candidates(None, running, ctx)
        if not self.preempts:
            return []
        counters = self.counters
        client = self.group_of(candidate)
        served = counters.get(client, 0.0)
        floor = served + self.preempt_margin
        by_client: dict[str, list[Request]] = {}
        for req in running:
            by_client.setdefault(self.group_of(req), []).append(req)
        rows = len(by_client.get(client, ()))
        shares = self._shares(ctx.config.max_running_requests) if self.preempt_for_share else {}
        under = rows < shares.get(client, 0.0)
        keyed = []
        for group, reqs in by_client.items():
            counter = counters.get(group, 0.0)
            if counter > floor:
                named = reqs
            elif under and group != client and counter >= served:
                # down to its share, and to no fewer than the candidate's client then runs
                over = min(len(reqs) - shares.get(group, 0.0), (len(reqs) - rows) / 2)
                named = sorted(reqs, key=_least_computed)[: max(0, math.floor(over))]
            else:
                continue
            for req in named:  # the most served client first, its least computed first
                keyed.append((-counter, *_least_computed(req), req))
        keyed.sort(key=lambda item: item[:4])
        return [item[4] for item in keyed]

    def _shares(self, slots: int) -> dict[str, float]:
        """Each client with requests in the engine -> its share of ``slots`` running requests,
        by weight."""
        live = [client for client, count in self._live.items() if count > 0]
        total = sum(self.weight(client) for client in live)
        return {client: slots * self.weight(client) / total for client in live}

    def candidates(self, waiting: Sequence[Request], size: int) -> list[Request]:
        """Each tenant's ``size`` oldest waiting requests (a window per tenant), in queue
        order. It scans the whole queue when that is longer than ``size``: a tenant's requests
        may all be far behind another's."""
        if len(waiting) <= size:
            return list(waiting)  # a copy: admission removes from the queue while it goes
        taken: dict[str, int] = {}
        chosen: list[Request] = []
        for req in waiting:
            tenant = self.group_of(req)
            count = taken.get(tenant, 0)
            if count < size:
                taken[tenant] = count + 1
                chosen.append(req)
        return chosen

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        queues: dict[str, list[Request]] = {}
        for req in waiting:
            if self._tenant_of_rid.get(req.rid) is None:
                self._register(req)
            queues.setdefault(self.group_of(req), []).append(req)
        if len(queues) == 1:
            return waiting
        # (virtual counter, requests in the engine per weight, position of the tenant's oldest
        # request, tenant, next index): at equal counters (a tenant back from idle is lifted to
        # the flood's) the one with fewer requests in the engine goes first, else it would wait
        # a step behind the flood's older backlog
        heap = [
            (self.counters.get(t, 0.0), self._live.get(t, 0) / self.weight(t), i, t, 0)
            for i, t in enumerate(queues)
        ]
        heapq.heapify(heap)
        ordered: list[Request] = []
        while heap:
            counter, load, position, tenant, index = heapq.heappop(heap)
            queue = queues[tenant]
            req = queue[index]
            ordered.append(req)
            if index + 1 < len(queue):
                charge = self.prefill_weight * req.num_tokens / self.weight(tenant)
                heapq.heappush(heap, (counter + charge, load, position, tenant, index + 1))
        return ordered
