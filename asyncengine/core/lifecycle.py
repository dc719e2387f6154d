"""Lifecycle: the one place a request's end is decided (core side: no torch, no asyncio).

Every way a request ends is here: a sampled token that is EOS or a stop token id, the output
length or the context limit, a stop string in its detokenized text (``Request.text``, filled
where the tokens land), its grammar completing (or refusing a token), its deadline
(``SamplingParams.timeout`` from arrival, ``max_queue_time`` while never scheduled), an abort, a
failed forward, and an n > 1 choice whose leader ended before prefilling the shared prompt.
The scheduler releases the request's queues and KV memory (``Scheduler.finish``); the ends
are counted here and reported to the driver as ``StepEvents`` (step_events.py).

n > 1 forks: the other choices of a request are held here until their leader's first token
(its prompt is in the radix cache then), and are handed to the scheduler at that point, so
they take the prompt's pages from the cache instead of computing them again.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Sequence

from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.core.tenant_stats import TenantStats
from asyncengine.scheduler.scheduler import Scheduler
from asyncengine.scheduler.step_events import StepEvents, TokenEvent

log = logging.getLogger("asyncengine.core.lifecycle")

COUNTERS = (
    "prompt_tokens",
    "generated_tokens",
    "finished_stop",
    "finished_length",
    "finished_abort",
    "finished_timeout",
    "failed",
)


class Lifecycle:
    def __init__(self, scheduler: Scheduler, eos_token_ids: Sequence[int]) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.tenants = TenantStats()
        self.followers: dict[str, list[Request]] = {}  # leader's id -> choices that fork it
        # (deadline, tie-break, request, queue-only): SamplingParams.timeout and max_queue_time
        self._deadlines: list[tuple[float, int, Request, bool]] = []
        self._deadline_order = itertools.count()
        self._ended: list[Request] = []  # since the last report
        self._released: list[Request] = []

    # -- arrivals ----------------------------------------------------------------------------
    def add(self, req: Request, followers: Sequence[Request] = ()) -> None:
        """Queue ``req``; ``followers`` (its n > 1 siblings, same prompt) join it once its
        prompt is cached (at once when the prefix cache is off), or, when it only scores its
        prompt (max_new_tokens 0), end with it: its scores are theirs, there is nothing else."""
        self._add(req)
        if not followers:
            return
        if self.scheduler.kv.enable_prefix_cache or req.params.max_new_tokens == 0:
            self.followers[req.rid] = list(followers)
        else:
            for follower in followers:
                self._add(follower)

    def _add(self, req: Request) -> None:
        self.scheduler.add_request(req)
        self.counters["prompt_tokens"] += len(req.prompt_ids)
        self.tenants.added(req)
        order, max_queue_time = self._deadline_order, self.scheduler.config.max_queue_time
        if req.params.timeout is not None:
            deadline = req.arrival_time + req.params.timeout
            heapq.heappush(self._deadlines, (deadline, next(order), req, False))
        if max_queue_time is not None:
            deadline = req.arrival_time + max_queue_time
            heapq.heappush(self._deadlines, (deadline, next(order), req, True))

    def next_deadline(self) -> float | None:
        """The earliest deadline still queued (its request may have ended since: ``expire``
        then finds nothing to end); None: none is."""
        deadlines = self._deadlines
        return deadlines[0][0] if deadlines else None

    def forget_counts(self) -> None:
        """Count requests, tokens and tenants again from zero (a replay's warm-up kept out of
        its measured run)."""
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.tenants = TenantStats()

    # -- endings -----------------------------------------------------------------------------
    def end(self, req: Request, reason: str, matched: str | int | None = None) -> None:
        """End ``req`` now (no-op if it has ended): its queues and KV are released (the
        computed prefix stays cached), and the choices waiting to fork it end with it."""
        if req.finished:
            return
        self.scheduler.finish(req, reason, matched)
        self._ended_one(req, reason)

    def _ended_one(self, req: Request, reason: str) -> None:
        self._ended.append(req)
        key = f"finished_{reason}"
        self.counters[key] = self.counters.get(key, 0) + 1
        self.tenants.generated(req, len(req.output_ids))  # a tenant's tokens count at the end
        if reason == "timeout":
            self.tenants.timed_out(req)
        for follower in self.followers.pop(req.rid, ()):
            follower.mark_finished(reason, None, self.scheduler.clock())
            self._ended_one(follower, reason)

    def abort(self, rid: str) -> bool:
        """End ``rid`` with reason "abort" (queued, running, or a choice waiting to fork)."""
        req = self.scheduler.requests.get(rid)
        if req is not None:
            self.end(req, "abort")
            return True
        for followers in self.followers.values():
            for follower in followers:
                if follower.rid == rid:
                    followers.remove(follower)
                    follower.mark_finished("abort", None, self.scheduler.clock())
                    self._ended_one(follower, "abort")
                    return True
        return False

    def expire(self) -> None:
        """End (reason "timeout") every request past its deadline: its own ``timeout`` from
        arrival, or ``max_queue_time`` while it has never been scheduled."""
        deadlines = self._deadlines
        if not deadlines:
            return
        now = self.scheduler.clock()
        while deadlines and deadlines[0][0] <= now:
            _, _, req, queue_only = heapq.heappop(deadlines)
            if req.finished or (queue_only and req.first_scheduled_time is not None):
                continue
            self.end(req, "timeout")

    def settle(self, tokens: list[TokenEvent], prompts_done: Sequence[Request] = ()) -> None:
        """After a commit: release the forks whose leader prefilled, end every request whose
        new token stops it, and every prefill-only request whose prompt is computed: an
        embedding ("stop"), or a request scoring its prompt with max_new_tokens 0 ("length").
        A request given several tokens in the step (accepted guesses) keeps those up to the one
        that ends it: the rest leave its output, ``tokens`` and its accepted count, as if never
        sampled."""
        for req in prompts_done:
            self.end(req, "stop" if req.embedding is not None else "length")
        kept: list[TokenEvent] = []
        for event in tokens:
            req = event.req
            if req.finished:  # an earlier token of this step ended it
                continue
            kept.append(event)
            if self.followers:
                for follower in self.followers.pop(req.rid, ()):
                    self._add(follower)
                    self._released.append(follower)
            reason, matched = self._stop(req, event.token_id, event.output_len)
            if reason is not None:
                # the tokens after it were accepted guesses but the step's last, sampled one
                dropped = len(req.output_ids) - event.output_len
                req.accepted_guesses -= max(0, dropped - 1)
                del req.output_ids[event.output_len :]
                del req.token_times[event.output_len :]
                self.end(req, reason, matched)
                event.finished = True
        self.counters["generated_tokens"] += len(kept)
        tokens[:] = kept

    def _stop(self, req: Request, token: int, n: int) -> tuple[str | None, str | int | None]:
        """Why ``token``, the ``n``-th token of ``req``'s output, ends it, if it does. Before
        ``min_new_tokens`` neither EOS, a stop token nor a stop string ends it (as vLLM); a
        stop string or a complete grammar on the last allowed token is a "stop", not "length"."""
        params = req.params
        may_stop = n >= params.min_new_tokens
        stop_token = may_stop and (
            (not params.ignore_eos and token in self.eos_token_ids)
            or token in params.stop_token_set
        )
        text = req.text
        # the text streams either way
        stop_string = None if text is None else text.push(token, may_stop)
        if stop_token:
            return "stop", token
        grammar = req.grammar
        if grammar is not None:
            if grammar.too_slow():  # its next mask would take longer still (structured/grammar.py)
                log.info("request %s: its grammar is too slow to follow; ended", req.rid)
                return "abort", None
            if not grammar.accept(token):
                if grammar.allows_nothing():  # the request's own constraint has a dead end
                    log.info("request %s: its grammar allows no next token; ended", req.rid)
                else:
                    log.error("request %s: token %d breaks its grammar", req.rid, token)
                return "abort", None
            if grammar.is_terminated():
                return "stop", token
        if stop_string is not None:
            return "stop", stop_string
        if n >= params.max_new_tokens or len(req.prompt_ids) + n >= self.scheduler.max_model_len:
            return "length", None
        return None, None

    def failed(self, failed: list[Request]) -> None:
        """A forward raised: ``failed``, its requests, ended (reason "abort", nothing cached)."""
        self.counters["failed"] += len(failed)
        for req in failed:
            self._ended.append(req)
            self.tenants.generated(req, len(req.output_ids))
            for follower in self.followers.pop(req.rid, ()):
                follower.mark_finished("abort", None, self.scheduler.clock())
                self._ended_one(follower, "abort")

    # -- reports -----------------------------------------------------------------------------
    def report(
        self,
        plan: BatchPlan | None = None,
        tokens: list[TokenEvent] | None = None,
        failed: list[Request] | None = None,
        error: BaseException | None = None,
        forward_seconds: float = 0.0,
    ) -> StepEvents:
        """The events since the last report (what ended, what was released), with a step's."""
        ended, self._ended = self._ended, []
        released, self._released = self._released, []
        return StepEvents(plan, tokens or [], ended, failed or [], released, error, forward_seconds)
