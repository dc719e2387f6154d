"""Planning ahead (overlap scheduling): the next plan made while the plan in flight has not
landed, so that the host plans step N+1 while the device runs step N.

Its decodes' input tokens are the ones step N samples, unknown to the host: each such decode
carries -1 and its index in ``BatchPlan.deferred``, and the executor takes the token from its
own last sampled tokens (on the device). Everything else of the plan is what planning after
the landing would give, when these hold:
- no speculative decoding (guesses are proposed from the landed tokens) and no policy that
  preempts (a request retracted while its token is in flight would lose it);
- decoding needs no retraction (every running request's next slot fits in free and evictable
  pages);
- every running request's sampling reads nothing of its own output: no grammar (its mask
  follows the last token), penalties or seed (they read the output), and no ``min_new_tokens``
  still banning stop tokens (it counts the output).
A request that step N ends (a stop token, a stop string: decided when N lands) also decodes in
step N+1; that token is dropped when N+1 lands, as an aborted request's is. One that step N
ends by length is left out: its length is known now.
"""

from __future__ import annotations

from asyncengine.cache.manager import KVCacheManager
from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.policies.base import Policy


def reads_own_output(req: Request) -> bool:
    """Whether sampling ``req``'s next token needs its last token on the host."""
    params: SamplingParams = req.params
    return (
        req.grammar is not None
        or params.seed is not None
        or params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or len(req.output_ids) < params.min_new_tokens
    )


def plan_ahead_allowed(
    running: list[Request], speculating: bool, policy: Policy, kv: KVCacheManager
) -> bool:
    """Whether the next plan, made before the plan in flight lands, is exact (module doc)."""
    if speculating or policy.preempts:
        return False
    ps = kv.page_size
    need = 0
    for req in running:
        if reads_own_output(req):
            return False
        if req.kv.kv_len % ps == 0:
            need += 1
    return need <= kv.available_pages


def decodes_ahead(
    running: list[Request], inflight: BatchPlan, kv: KVCacheManager, max_model_len: int
) -> list[Request]:
    """The running requests that decode in the plan made ahead of ``inflight``, each given the
    KV slot of its next token: all but those whose token in flight is their last by length."""
    sampled = {seg.rid for seg in inflight.decodes}
    decoding: list[Request] = []
    for req in running:
        left = req.future_tokens(max_model_len)
        if req.rid in sampled:
            left -= 1
        if left > 0:
            kv.extend(req.kv, 1)
            decoding.append(req)
    return decoding


def add_deferred_decodes(plan: BatchPlan, decoding: list[Request], inflight: BatchPlan) -> None:
    """``decoding``'s segments into ``plan``: a request ``inflight`` samples gets input -1 and
    its index in ``plan.deferred`` (its token is the executor's to fill in)."""
    sampled = {seg.rid for seg in inflight.decodes}
    for req in decoding:
        seq = req.kv
        if req.rid in sampled:
            plan.deferred.append(len(plan.decodes))
            plan.decodes.append(
                Segment(req.rid, seq.row, [-1], seq.kv_len - 1, True, lora=req.lora)
            )
        else:
            last = req.output_ids[-1] if req.output_ids else req.prompt_ids[-1]
            plan.decodes.append(
                Segment(req.rid, seq.row, [last], seq.kv_len - 1, True, lora=req.lora)
            )
        plan.sampling.append(SamplingInfo(req.params, req.prompt_ids, req.output_ids))
