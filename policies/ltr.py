"""ltr: learning to rank, the shortest predicted output first (Fu et al., "Efficient LLM
Scheduling by Learning to Rank", NeurIPS 2024; vLLM #29366).

Requests are ranked by the output tokens the engine's ``length_predictor`` expects them to
generate still (``ranker`` or ``history`` learn it online), not by prompt size: decoding is
where long jobs hold the batch. Waiting is aged and capped as in sjf (``aging``,
``max_wait_tokens``), so a request predicted long still runs under a stream of short ones.
"""

from __future__ import annotations

from asyncengine.common.request import Request
from asyncengine.policies.base import PolicyContext
from asyncengine.policies.sjf import SJFPolicy


class LTRPolicy(SJFPolicy):
    name = "ltr"

    def job_tokens(self, req: Request, ctx: PolicyContext) -> float:
        return self.output_tokens(req, ctx)
