"""A shadow policy: asked to order the same waiting queue as the live policy every step, never
acting on its answer, so a policy can be tried on live traffic before it is switched on.

Each step where the live policy orders the queue, the shadow orders a copy of it and the two
answers are compared: whether their first picks are the same request, and how much their top
``top_k`` overlap (|live top-k ∩ shadow top-k| / k, with k no larger than either list). The
shadow hears every finished step and request (``observe``, ``finished``) as the live policy
does, so policies that learn (latency models, tenant counters) learn from the same run.
"""

from __future__ import annotations

from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext


class ShadowPolicy:
    def __init__(self, policy: Policy, top_k: int = 4) -> None:
        if top_k < 1:
            raise ValueError(f"shadow top_k must be >= 1, got {top_k}")
        self.policy = policy
        self.top_k = top_k
        self.decisions = 0  # steps compared
        self.first_agree = 0  # steps whose first picks were the same request
        self.top_k_overlap = 0.0  # summed overlap fraction of the top-k
        self.top_k_same = 0  # steps whose top-k were the same set

    def compare(self, window: list[Request], live: list[Request], ctx: PolicyContext) -> None:
        """Order ``window`` with the shadow and count how its answer agrees with ``live``."""
        shadow = self.policy.order(list(window), ctx)
        if not live and not shadow:
            return
        self.decisions += 1
        if live and shadow and live[0] is shadow[0]:
            self.first_agree += 1
        k = min(self.top_k, len(live), len(shadow))
        if k == 0:
            return
        live_top = {id(req) for req in live[:k]}
        common = sum(1 for req in shadow[:k] if id(req) in live_top)
        self.top_k_overlap += common / k
        if common == k:
            self.top_k_same += 1

    def observe(self, plan: BatchPlan, seconds: float) -> None:
        self.policy.observe(plan, seconds)

    def finished(self, req: Request) -> None:
        self.policy.finished(req)

    def stats(self) -> dict[str, float | str]:
        n = self.decisions
        return {
            "policy": self.policy.name,
            "top_k": self.top_k,
            "decisions": n,
            "first_pick_agree": self.first_agree,
            "top_k_same": self.top_k_same,
            "first_pick_agreement": self.first_agree / n if n else 0.0,
            "top_k_agreement": self.top_k_overlap / n if n else 0.0,
        }
