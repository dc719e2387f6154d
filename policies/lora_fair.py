"""lora-fair: virtual token counters per LoRA adapter (VTC, as ``fair`` keeps per tenant).

The same machinery as ``fair`` (policies/fair.py), with the request's adapter as the client:
each adapter (``SamplingParams.lora``; base-model requests share the client "") is charged the
service its requests got, weighted by ``weights`` (adapter name -> weight) or
``default_weight``, and the waiting queue is served adapter by adapter, the least served
first. One adapter flooding the engine then delays its own requests, not the other adapters':
their counters stay low, so they are ordered ahead of its backlog. An adapter that was idle
starts from the active floor (no banked service). ``policy_window`` applies per adapter. The
options are ``fair``'s (``max_idle_tenants`` bounds the idle adapters remembered), and it
preempts by default (``preempt = false`` turns it off): a request of an adapter whose counter
is ``preempt_margin`` below the most served one's, or that runs fewer requests than an adapter
served no less (``preempt_for_share``), does not wait for the flood's running requests to
finish (they are retracted, their computed prefix cached, and resume later).

Composes with budgets as the other orderings do (``lora-fair+token-budget``). Whether an
adapter can join the step (``max_loras``) is admission's to decide: it passes over one that
cannot, to the next in this order.
"""

from __future__ import annotations

from asyncengine.common.request import Request
from asyncengine.policies.fair import FairPolicy


class LoraFairPolicy(FairPolicy):
    name = "lora-fair"
    preempt_by_default = True

    def group_of(self, req: Request) -> str:
        return req.params.lora or ""
