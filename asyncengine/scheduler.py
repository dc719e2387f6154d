"""Scheduler: turns waiting and running requests into BatchPlans, and commits their results.

Shared by every policy: the policy only orders the waiting queue and sets the step's token
budgets. The scheduler admits under those budgets and a KV memory check, chunks long
prefills (at most one request mid-chunk, and it goes first), mixes decodes into prefill
steps, retracts running requests when decode runs out of KV pages, and keeps the radix cache
in step with every request's life. It never touches tensors.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncengine.cache.allocator import OutOfPagesError
from asyncengine.cache.manager import KVCacheManager
from asyncengine.config import EngineConfig
from asyncengine.plan import BatchPlan, SamplingInfo, Segment, StepOutput, TokenLogprobs
from asyncengine.policies.base import Policy, PolicyContext, StepBudget
from asyncengine.request import Request, RequestStatus
from asyncengine.step_prefixes import StepPrefixes

log = logging.getLogger("asyncengine.scheduler")


@dataclass(slots=True)
class TokenEvent:
    """One sampled token for one request, and whether that token finished it."""

    req: Request
    token_id: int
    logprobs: TokenLogprobs | None
    finished: bool


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        policy: Policy,
        eos_token_ids: list[int],
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.clock = clock
        self.page_size = kv.page_size
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []  # admitted; prompt not fully computed
        self.running: list[Request] = []  # decoding
        self.requests: dict[str, Request] = {}
        self.chunked: Request | None = None  # the one request mid-chunk
        self.new_token_ratio = config.init_new_token_ratio
        self.step_count = 0
        self.consecutive_prefill_steps = 0
        self.total_retractions = 0
        self.total_prefix_deferrals = 0
        self.inflight: BatchPlan | None = None
        # rid -> (request, segment) of the plan in flight. A request aborted while its step
        # runs leaves ``requests``, and a new one may take its id at once: commit and fail go
        # by these objects, so the old step's token never lands on the new request.
        self._inflight_owners: dict[str, tuple[Request, Segment]] = {}
        # the uncached prefixes this step's prefills compute, when in-batch dedup is on
        self.step_prefixes: StepPrefixes | None = None
        if config.enable_inbatch_prefix_dedup and kv.enable_prefix_cache:
            self.step_prefixes = StepPrefixes(self.page_size)

    # -- queue ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in the engine")
        req.status = RequestStatus.WAITING
        self.requests[req.rid] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def abort(self, rid: str) -> Request | None:
        """Finish ``rid`` with reason "abort" and release its KV (its computed prefix stays cached)."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return None
        self.finish(req, "abort")
        return req

    def finish(
        self, req: Request, reason: str, matched: str | int | None = None, cache: bool = True
    ) -> None:
        """End ``req`` now: leave every queue, close its KV (computed prefix into the tree)."""
        if req.finished:
            return
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.PREFILLING:
            self.prefilling.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        if req.seq is not None:
            self.kv.close(req.kv, req.all_ids[: self._computed_len(req)], cache=cache)
            req.seq = None
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.matched_stop = matched
        req.finished_time = self.clock()
        del self.requests[req.rid]

    # -- planning -------------------------------------------------------------------------
    def _computed_len(self, req: Request) -> int:
        """Tokens whose KV is written: a segment of the step in flight is not, yet."""
        owner = self._inflight_owners.get(req.rid)
        if owner is not None and owner[0] is req:
            return owner[1].start_pos
        return req.kv.kv_len

    def _context(self, num_decodes: int) -> PolicyContext:
        return PolicyContext(
            config=self.config,
            now=self.clock(),
            num_running=len(self.running) + len(self.prefilling),
            num_decodes=num_decodes,
            prefix_len=self.kv.match_length,
            chunked=self.chunked,
        )

    def _future_tokens(self, req: Request) -> int:
        """Tokens ``req`` may still generate: its budget, capped by the context length."""
        return max(0, min(req.remaining_new_tokens, self.max_model_len - req.num_tokens))

    def _reserved_tokens(self) -> int:
        """Future tokens of every admitted request, before ``new_token_ratio``.

        ``_future_tokens`` inlined: this runs every step over every running request."""
        cap = self.max_model_len
        total = 0
        for queue in (self.running, self.prefilling):
            for r in queue:
                out = len(r.output_ids)
                total += max(0, min(r.params.max_new_tokens - out, cap - len(r.prompt_ids) - out))
        return total

    def schedule(self) -> BatchPlan | None:
        """Build the next step's plan, or None when there is nothing to run."""
        self.step_count += 1
        plan = BatchPlan(step=self.step_count)
        mixed = self.config.enable_mixed_batch
        starved = self.consecutive_prefill_steps >= self.config.max_consecutive_prefill_steps
        prefill_wanted = bool(self.waiting or self.prefilling)
        decoding: list[Request] = []
        if mixed or not prefill_wanted or (starved and self.running):
            decoding = self._prepare_decodes()
        if prefill_wanted and (mixed or not decoding):
            budget = self.policy.budget(self._context(len(decoding)))
            self._admit(plan, budget, len(decoding))
        if not decoding and not plan.extends and self.running and not mixed:
            decoding = self._prepare_decodes()  # nothing could be admitted: decode instead
            if not decoding and prefill_wanted:  # it retracted everything: memory is free now
                self._admit(plan, self.policy.budget(self._context(0)), 0)
        for req in decoding:
            plan.decodes.append(self._decode_segment(req))
            plan.sampling.append(SamplingInfo(req.params, req.prompt_ids, req.output_ids))
        if plan.extends and not plan.decodes:
            self.consecutive_prefill_steps += 1
        else:
            self.consecutive_prefill_steps = 0
        if plan.decodes and not plan.extends:
            self.new_token_ratio = max(
                self.config.min_new_token_ratio,
                self.new_token_ratio - self.config.new_token_ratio_decay,
            )
        if plan.is_empty():
            return None
        plan.page_writes = self.kv.page_table.drain_writes()
        now = self.clock()
        requests = self.requests
        owners = {}
        for seg in plan.extends:
            req = requests[seg.rid]
            owners[seg.rid] = (req, seg)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        for seg in plan.decodes:
            owners[seg.rid] = (requests[seg.rid], seg)
        self.inflight = plan
        self._inflight_owners = owners
        return plan

    def _decode_segment(self, req: Request) -> Segment:
        last = req.output_ids[-1] if req.output_ids else req.prompt_ids[-1]
        return Segment(req.rid, req.kv.row, [last], req.kv.kv_len - 1, sample=True)

    def _prepare_decodes(self) -> list[Request]:
        """Give every running request a KV slot for its next token, retracting when short."""
        ps = self.page_size
        retracted: list[Request] = []
        while self.running:
            need = sum(1 for r in self.running if r.kv.kv_len % ps == 0)
            if need <= self.kv.available_pages:
                break
            victim = self._pick_victim()
            self._retract(victim)
            retracted.append(victim)
        if retracted:
            log.warning(
                "KV pages ran out: retracted %d request(s) (%s) to be recomputed; %d keep decoding",
                len(retracted),
                ", ".join(r.rid for r in retracted[:8]) + (" ..." if len(retracted) > 8 else ""),
                len(self.running),
            )
        for req in self.running:
            self.kv.extend(req.kv, 1)
        return list(self.running)

    def _pick_victim(self) -> Request:
        """Retract the request that loses least work: fewest outputs, then the longest prompt."""
        return min(self.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))

    def _retract(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.close(req.kv, req.all_ids[: req.kv.kv_len], cache=True)
        req.seq = None
        req.status = RequestStatus.WAITING
        req.retractions += 1
        self.total_retractions += 1
        self.waiting.insert(0, req)
        self.new_token_ratio = self.config.init_new_token_ratio

    def _admit(self, plan: BatchPlan, budget: StepBudget, num_decodes: int) -> None:
        """Fill ``plan.extends`` under the step's token budget and the KV memory check."""
        chunk = budget.chunk_size
        # With chunking on, the chunk bounds the whole step's prefill, not only one prompt's
        # piece of it (as SGLang's chunked_prefill_size): otherwise a step could carry one
        # prompt's last chunk, the next prompt's first and short prompts between them.
        remaining = min(budget.prefill_tokens, chunk) if chunk else budget.prefill_tokens
        if budget.total_tokens is not None:
            remaining = min(remaining, budget.total_tokens - num_decodes)
        ps = self.page_size
        dedup = self.step_prefixes
        if dedup is not None:
            dedup.clear()
        # the request mid-chunk goes first
        for req in list(self.prefilling):
            if remaining <= 0:
                return
            todo = req.num_tokens - req.kv.kv_len
            take = min(todo, remaining, chunk) if chunk else todo
            if take < todo and chunk and take >= ps:
                take = take // ps * ps
            computed = req.kv.kv_len
            if not self._try_extend(req, take):
                return
            self._add_extend(plan, req, take)
            if dedup is not None:
                dedup.add(req.all_ids, computed)
            remaining -= take
        slots = self.config.max_running_requests - len(self.running) - len(self.prefilling)
        if not self.waiting or remaining <= 0 or slots <= 0 or (self.chunked is not None and chunk):
            return  # nothing can be admitted: skip the policy's ordering work
        reserved = self._reserved_tokens()
        ratio = self.new_token_ratio
        alone = not self.running and not self.prefilling and not plan.extends
        if not alone and math.ceil(reserved * ratio / ps) + 1 > self.kv.available_pages:
            return  # not even a one-page request would fit
        # The policy orders the oldest ``policy_window`` requests; the rest wait in arrival
        # order, which bounds each step's ordering cost when the queue is very long.
        window = self.waiting[: self.config.policy_window]
        for req in self.policy.order(window, self._context(num_decodes)):
            if remaining <= 0 or slots <= 0:
                break
            if self.chunked is not None and chunk:
                break  # at most one request mid-chunk
            ids = req.all_ids
            matched = self.kv.match_length(ids)
            if dedup is not None and dedup.shares(ids, matched):
                # another prompt of this step computes the same uncached page: left waiting,
                # this one takes it (and whatever more they share) from the cache next step
                self.total_prefix_deferrals += 1
                continue
            estimate = len(ids) - matched
            future = self._future_tokens(req)
            need = self.kv.pages_needed(None, estimate) + math.ceil(
                (reserved + future) * ratio / ps
            )
            alone = not self.running and not self.prefilling and not plan.extends
            if not alone and need > self.kv.available_pages:
                break
            if not chunk and estimate > remaining and not alone:
                break  # chunking off: a prompt over the budget runs alone
            if chunk and ps <= estimate and remaining < ps and not alone:
                break  # the budget left is less than a page: start this prompt next step
            req.seq = self.kv.open(ids)
            todo = len(ids) - req.kv.kv_len
            take = todo if not chunk else min(todo, remaining, chunk)
            if take < todo and take >= ps:
                take = take // ps * ps
            if not self._try_extend(req, take):
                self.kv.close(req.kv, [], cache=False)
                req.seq = None
                break
            self.waiting.remove(req)
            req.status = RequestStatus.PREFILLING
            if req.retractions == 0:
                req.cached_tokens = req.kv.num_cached
            self.prefilling.append(req)
            self._add_extend(plan, req, take)
            if dedup is not None:
                dedup.add(ids, req.kv.num_cached)
            remaining -= take
            slots -= 1
            reserved += future

    def _try_extend(self, req: Request, take: int) -> bool:
        try:
            self.kv.extend(req.kv, take)
            return True
        except OutOfPagesError:
            return False

    def _add_extend(self, plan: BatchPlan, req: Request, take: int) -> None:
        start = req.kv.kv_len - take
        done = req.kv.kv_len == req.num_tokens
        ids = req.all_ids[start : start + take]
        plan.extends.append(Segment(req.rid, req.kv.row, ids, start, sample=done))
        if done:
            plan.sampling.append(SamplingInfo(req.params, req.prompt_ids, req.output_ids))
            if self.chunked is req:
                self.chunked = None
        else:
            self.chunked = req

    # -- results --------------------------------------------------------------------------
    def commit(self, plan: BatchPlan, output: StepOutput) -> list[TokenEvent]:
        """Apply a finished step: append sampled tokens, check token-level stops, cache chunks."""
        owners = self._owners(plan)
        self.inflight = None  # its KV is written now
        self._inflight_owners = {}
        self.policy.observe(plan, output.forward_seconds)
        now = self.clock()
        events: list[TokenEvent] = []
        sampled = iter(zip(output.token_ids, output.logprobs, strict=True))
        for seg in plan.segments:
            req = owners.get(seg.rid)
            alive = req is not None and not req.finished  # else aborted while the step ran
            if not seg.sample:
                if req is not None and alive:  # the chunk is shareable now
                    self.kv.cache(req.kv, req.all_ids[: req.kv.kv_len])
                continue
            token, logprobs = next(sampled)
            if req is None or not alive:
                continue
            if req.status is RequestStatus.PREFILLING:
                self.prefilling.remove(req)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                # the whole prompt is in KV now: share it while this request still decodes
                self.kv.cache(req.kv, req.all_ids[: req.kv.kv_len])
            req.output_ids.append(token)
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            reason, matched = self._token_stop(req, token)
            if reason is not None:
                self.finish(req, reason, matched)
            events.append(TokenEvent(req, token, logprobs, reason is not None))
        return events

    def fail(self, plan: BatchPlan) -> list[Request]:
        """The step's forward raised: end its requests (reason "abort") and return them.

        Their KV is not trusted, so nothing of theirs enters the prefix cache. The plan's page
        writes go back to the front of the log: the executor may not have applied them, and
        the next plan replays them (applying a write twice is harmless).
        """
        self.kv.page_table.requeue(plan.page_writes)
        failed = []
        owners = self._owners(plan)
        for seg in plan.segments:
            req = owners.get(seg.rid)
            if req is not None and not req.finished:
                self.finish(req, "abort", cache=False)
                failed.append(req)
        self.inflight = None
        self._inflight_owners = {}
        return failed

    def _owners(self, plan: BatchPlan) -> dict[str, Request | None]:
        """The request each segment of ``plan`` was planned for (None: it is gone)."""
        if plan is self.inflight:
            return {rid: owner[0] for rid, owner in self._inflight_owners.items()}
        return {seg.rid: self.requests.get(seg.rid) for seg in plan.segments}

    def _token_stop(self, req: Request, token: int) -> tuple[str | None, str | int | None]:
        params = req.params
        n = len(req.output_ids)
        if n >= params.min_new_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", token
            if token in params.stop_token_ids:
                return "stop", token
        if n >= params.max_new_tokens or req.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    # -- introspection --------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        kv = self.kv.stats()
        return {
            **kv,
            "running": len(self.running),
            "prefilling": len(self.prefilling),
            "waiting": len(self.waiting),
            "retractions": self.total_retractions,
            "prefix_deferrals": self.total_prefix_deferrals,
            "new_token_ratio": self.new_token_ratio,
            "steps": self.step_count,
        }
