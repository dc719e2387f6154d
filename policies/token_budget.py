"""token-budget: admit by tokens, not by request count.

Each step may spend at most ``prefill_tokens`` on prefill and ``total_tokens`` on prefill and
decode together, so a burst of long prompts cannot stretch one step (and every running
request's inter-token latency) past a bound.
"""

from __future__ import annotations

from typing import Any

from asyncengine.policies.base import Policy, PolicyContext, StepBudget, take_options


class TokenBudgetPolicy(Policy):
    name = "token-budget"
    budgets = True
    sees_decodes = False  # Policy.sees_decodes: it reads no decode

    def __init__(self, **options: Any) -> None:
        opts = take_options(self.name, options, {"prefill_tokens": 512, "total_tokens": 768})
        if opts["prefill_tokens"] < 1 or opts["total_tokens"] < 1:
            raise ValueError("policy 'token-budget': budgets must be >= 1")
        self.prefill_tokens = opts["prefill_tokens"]
        self.total_tokens = opts["total_tokens"]

    def budget(self, ctx: PolicyContext) -> StepBudget:
        chunk = ctx.config.chunked_prefill_size
        prefill = min(self.prefill_tokens, ctx.config.max_prefill_tokens)
        return StepBudget(
            prefill_tokens=prefill,
            total_tokens=self.total_tokens,
            chunk_size=min(chunk, prefill) if chunk else 0,
        )
