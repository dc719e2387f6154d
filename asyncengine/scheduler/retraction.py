"""Retraction: the scheduler's decode side when KV memory runs short.

Every running request gets a KV slot for its next token each step; when pages run short, the
running requests that lose least work are retracted (back to the front of the waiting queue,
their computed prefix cached, recomputed later; they never re-emit a token). A preempting
policy may also name running requests to retract for a waiting one it wants to admit. A
retracted request's KV is swapped out to the host (``preemption_mode = "swap"``) or computed
again: this keeps either until it is admitted again, and counts the recompute it costs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from asyncengine.cache.manager import KVCacheManager
from asyncengine.cache.swap_space import SwappedKV
from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request, RequestStatus
from asyncengine.policies.base import Policy, PolicyContext
from asyncengine.policies.victims import order_victims
from asyncengine.scheduler.policy_guard import PolicyFailed, victims_named
from asyncengine.scheduler.waiting_queue import WaitingQueue

log = logging.getLogger("asyncengine.scheduler.scheduler")


class Retraction:
    """Makes room in KV memory by retracting running requests; the scheduler's queues are
    held here by reference, the policy and config of the step passed. A retracted request
    goes to the front of the waiting queue: the caller tells the admission counts."""

    def __init__(
        self,
        kv: KVCacheManager,
        waiting: WaitingQueue,
        running: list[Request],
        policy_failed: PolicyFailed,
    ) -> None:
        self.policy_failed = policy_failed  # a hook that fails names no victim (policy_guard.py)
        self.kv = kv
        self.page_size = kv.page_size
        self.waiting = waiting
        self.running = running
        self.total_retractions = 0
        self.total_preemptions = 0  # retractions a policy asked for (counted in retractions too)
        # id(request) -> its swapped-out KV, or the tokens it had computed when retracted for
        # recompute (computing them again is the recompute tax)
        self.swapped: dict[int, SwappedKV] = {}
        self.recompute_until: dict[int, int] = {}
        self.total_computed_tokens = 0
        self.total_prefill_computed_tokens = 0  # of them, the extends' (prompt chunks)
        self.total_recomputed_tokens = 0
        self.swap_seconds = 0.0

    def make_decode_room(
        self,
        guesses: dict[str, list[int]],
        drafts: dict[str, int],
        policy: Policy,
        config: EngineConfig,
        context: Callable[[int], PolicyContext],
    ) -> list[Request]:
        """Give every running request the KV slots of its next token and its guesses
        (speculative decoding: guessed tokens, or how many a draft model guesses, by rid),
        retracting when short: the guesses are dropped (the dicts emptied) before anyone is
        retracted. Returns those retracted."""
        ps = self.page_size
        kv = self.kv
        retracted: list[Request] = []
        victims: list[Request] | None = None
        while self.running:
            if guesses or drafts:
                need = sum(
                    kv.pages_needed(r.kv, 1 + guess_slots(r, guesses, drafts)) for r in self.running
                )
            else:
                need = sum(1 for r in self.running if r.kv.kv_len % ps == 0)
            if need <= kv.available_pages:
                break
            if guesses or drafts:
                guesses.clear()
                drafts.clear()
                continue
            if victims is None:
                victims = self._shortage_victims(policy, config, context(0))
            victim = victims.pop(0)
            self.retract(victim, config)
            retracted.append(victim)
        if retracted:
            log.warning(
                "KV pages ran out: retracted %d request(s) (%s) to be recomputed; %d keep decoding",
                len(retracted),
                ", ".join(r.rid for r in retracted[:8]) + (" ..." if len(retracted) > 8 else ""),
                len(self.running),
            )
        for req in self.running:
            kv.extend(req.kv, 1 + guess_slots(req, guesses, drafts))
        return retracted

    def _shortage_victims(
        self, policy: Policy, config: EngineConfig, ctx: PolicyContext
    ) -> list[Request]:
        """Every running request, in the order they go when KV runs short: the policy's
        choice (``preempt_candidates`` with no candidate; by default the config's
        ``preemption_victim`` rule), then those it left out in the config's order."""
        running = list(self.running)
        named = victims_named(policy, None, running, ctx, self.policy_failed)
        seen = {id(victim) for victim in named}
        left = [r for r in running if id(r) not in seen]
        return list(named) + order_victims(config.preemption_victim, left)

    def retract(self, req: Request, config: EngineConfig) -> None:
        """Back to the front of the waiting queue; the KV it computed goes into the tree (not
        the slot this step's decode was given). With ``preemption_mode = "swap"`` that KV is
        also copied to the host buffer and copied back on re-admission; otherwise (or when the
        buffer is full) what the tree no longer holds then is recomputed."""
        self.running.remove(req)
        seq = req.kv
        swapped = self.kv.swap_out(seq) if config.preemption_mode == "swap" else None
        if swapped is not None:
            self.swapped[id(req)] = swapped
        else:
            self.recompute_until[id(req)] = seq.computed_len
        self.kv.close(seq, req.cache_ids[: seq.computed_len], cache=True)
        req.seq = None
        req.status = RequestStatus.WAITING
        req.retractions += 1
        self.total_retractions += 1
        self.waiting.push_front(req)

    def preempt_for(
        self,
        req: Request,
        policy: Policy,
        config: EngineConfig,
        ctx: PolicyContext,
        pages_short: int,
        slots_short: int,
        ratio: float,
        cap: int,
    ) -> list[Request] | None:
        """Retract the running requests ``policy`` names for ``req``, as few as make room for
        ``pages_short`` pages and ``slots_short`` slots (their reservations at ``ratio``, their
        length capped at ``cap``); none (None) when all of them would not."""
        if not policy.preempts or not self.running:
            return None
        candidates = victims_named(policy, req, list(self.running), ctx, self.policy_failed)
        ps = self.page_size
        chosen: list[Request] = []
        pages = slots = 0
        for victim in candidates:
            chosen.append(victim)
            # at least what retracting it frees: its own pages, the floor of its reservation
            pages += self.kv.own_pages(victim.kv) + int(victim.future_tokens(cap) * ratio / ps)
            slots += 1
            if pages >= pages_short and slots >= slots_short:
                break
        else:
            return None
        for victim in chosen:
            self.retract(victim, config)
            self.total_preemptions += 1
        log.info(
            "preempted %s for %s (policy %s)",
            ", ".join(v.rid for v in chosen),
            req.rid,
            policy.name,
        )
        return chosen

    def forget(self, req: Request) -> None:
        """``req`` left the engine: its swapped-out KV (if any) is dropped."""
        if not self.swapped and not self.recompute_until:
            return
        swapped = self.swapped.pop(id(req), None) if self.swapped else None
        if swapped is not None:
            assert self.kv.swap is not None
            self.kv.swap.drop(swapped)
        self.recompute_until.pop(id(req), None)

    def count_computed(
        self, plan: BatchPlan, owners: dict[str, Request | None], swap_seconds: float
    ) -> None:
        """Tokens the step computed, those of them computed before (retracted and recomputed:
        the recompute tax), and the time its swap copies took."""
        self.total_computed_tokens += plan.num_tokens
        self.total_prefill_computed_tokens += sum(s.num_tokens for s in plan.extends)
        self.swap_seconds += swap_seconds
        debts = self.recompute_until
        if not debts:
            return
        for seg in plan.extends:
            req = owners.get(seg.rid)
            until = None if req is None else debts.get(id(req))
            if until is None:
                continue
            assert req is not None
            self.total_recomputed_tokens += max(0, min(until, seg.end_pos) - seg.start_pos)
            if seg.end_pos >= until:
                del debts[id(req)]

    def preemption_stats(self) -> dict[str, float]:
        computed = self.total_computed_tokens
        return {
            "computed_tokens": computed,
            "prefill_computed_tokens": self.total_prefill_computed_tokens,
            "recomputed_tokens": self.total_recomputed_tokens,
            "recompute_tax": self.total_recomputed_tokens / computed if computed else 0.0,
            "swap_seconds": self.swap_seconds,
        }


def guess_slots(req: Request, guesses: dict[str, list[int]], drafts: dict[str, int]) -> int:
    """KV slots the step's guesses of ``req`` take (speculative decoding)."""
    return len(guesses.get(req.rid, ())) + drafts.get(req.rid, 0)
