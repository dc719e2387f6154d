"""Retraction: the scheduler's decode side when KV memory runs short (part of Scheduler).

Every running request gets a KV slot for its next token each step; when pages run short, the
running requests that lose least work are retracted (back to the front of the waiting queue,
their computed prefix cached, recomputed later; they never re-emit a token). A preempting
policy may also name running requests to retract for a waiting one it wants to admit.
"""

from __future__ import annotations

import logging

from asyncengine.admission import AdmissionLog
from asyncengine.cache.swap_space import SwappedKV
from asyncengine.config import EngineConfig
from asyncengine.plan import BatchPlan
from asyncengine.policies.base import Policy, PolicyContext
from asyncengine.policies.victims import order_victims
from asyncengine.prefill import Prefill
from asyncengine.request import Request, RequestStatus
from asyncengine.speculative.ngram import NgramProposer
from asyncengine.speculative.settings import SpeculativeConfig

log = logging.getLogger("asyncengine.scheduler")


class Retraction(Prefill):
    """Scheduler's base (one chain of bases, not mixins, so that mypyc compiles the three as
    one native class), whose state these are; ``Prefill``'s are declared there."""

    config: EngineConfig
    policy: Policy
    admission: AdmissionLog
    max_model_len: int
    new_token_ratio: float
    running: list[Request]
    total_retractions: int
    total_preemptions: int
    speculation: SpeculativeConfig | None
    step_guesses: dict[str, list[int]]
    step_drafts: dict[str, int]
    recompute_until: dict[int, int]
    total_computed_tokens: int
    total_recomputed_tokens: int
    swap_seconds: float

    def _context(self, num_decodes: int) -> PolicyContext:
        raise NotImplementedError  # Scheduler's

    def _prepare_decodes(self) -> list[Request]:
        """Give every running request a KV slot for its next token (and its guesses, with
        speculative decoding), retracting when short: guesses are dropped before anyone is."""
        ps = self.page_size
        guesses, drafts = self._propose_guesses()
        self.step_guesses, self.step_drafts = guesses, drafts
        retracted: list[Request] = []
        victims: list[Request] | None = None
        while self.running:
            if guesses or drafts:
                kv = self.kv
                need = sum(kv.pages_needed(r.kv, 1 + self._guess_slots(r)) for r in self.running)
            else:
                need = sum(1 for r in self.running if r.kv.kv_len % ps == 0)
            if need <= self.kv.available_pages:
                break
            if guesses or drafts:
                guesses.clear()
                drafts.clear()
                continue
            if victims is None:
                victims = self._shortage_victims()
            victim = victims.pop(0)
            self._retract(victim)
            self.new_token_ratio = self.config.init_new_token_ratio
            retracted.append(victim)
        if retracted:
            log.warning(
                "KV pages ran out: retracted %d request(s) (%s) to be recomputed; %d keep decoding",
                len(retracted),
                ", ".join(r.rid for r in retracted[:8]) + (" ..." if len(retracted) > 8 else ""),
                len(self.running),
            )
        for req in self.running:
            self.kv.extend(req.kv, 1 + self._guess_slots(req))
        return list(self.running)

    def _guess_slots(self, req: Request) -> int:
        """KV slots this step's guesses of ``req`` take (speculative decoding)."""
        return len(self.step_guesses.get(req.rid, ())) + self.step_drafts.get(req.rid, 0)

    def _propose_guesses(self) -> tuple[dict[str, list[int]], dict[str, int]]:
        """Speculative decoding: each running request's guessed next tokens (by rid), as many
        as the policy allows it (``Policy.speculate``) and its output budget and the context
        leave room for (the token after the guesses is sampled too). With a draft model the
        executor guesses them: the second dict says how many, by rid. Empty when off."""
        settings = self.speculation
        if settings is None or not self.running:
            return {}, {}
        ctx = self._context(len(self.running))
        room = min(self.max_model_len, self.kv.max_tokens_per_request) - 1
        out: dict[str, list[int]] = {}
        drafts: dict[str, int] = {}
        for req in self.running:
            k = min(self.policy.speculate(req, ctx), req.remaining_new_tokens - 1)
            k = max(0, min(k, room - req.num_tokens))
            if settings.method == "draft":
                # a grammar's mask after each guess is made before the forward (core.launch),
                # so a structured-output request's guesses must be known here: it gets none
                if k and req.grammar is None:
                    drafts[req.rid] = k
                continue
            if req.proposer is None:
                req.proposer = NgramProposer(settings.prompt_lookup_min, settings.prompt_lookup_max)
            guesses = req.proposer.propose(req.all_ids, k)  # indexes even when k is 0
            if guesses:
                out[req.rid] = guesses
        return out, drafts

    def _shortage_victims(self) -> list[Request]:
        """Every running request, in the order they go when KV runs short: the policy's
        choice (``preempt_candidates`` with no candidate; by default the config's
        ``preemption_victim`` rule), then those it left out in the config's order."""
        running = list(self.running)
        named = self.policy.preempt_candidates(None, running, self._context(0))
        seen: set[int] = set()
        for victim in named:
            if victim.status is not RequestStatus.RUNNING or id(victim) in seen:
                raise ValueError(
                    f"policy {self.policy.name!r} named {victim.rid!r} to preempt, "
                    "which is not a running request (or named it twice)"
                )
            seen.add(id(victim))
        left = [r for r in running if id(r) not in seen]
        return list(named) + order_victims(self.config.preemption_victim, left)

    def _retract(self, req: Request) -> None:
        """Back to the front of the waiting queue; the KV it computed goes into the tree (not
        the slot this step's decode was given). With ``preemption_mode = "swap"`` that KV is
        also copied to the host buffer and copied back on re-admission; otherwise (or when the
        buffer is full) what the tree no longer holds then is recomputed."""
        self.running.remove(req)
        seq = req.kv
        swapped = self.kv.swap_out(seq) if self.config.preemption_mode == "swap" else None
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
        self.admission.arrived(req, front=True)

    def _preempt_for(
        self, req: Request, ctx: PolicyContext, pages_short: int, slots_short: int
    ) -> list[Request] | None:
        """Retract the running requests the policy names for ``req``, as few as make room for
        ``pages_short`` pages and ``slots_short`` slots; none (None) when all of them would not."""
        if not self.policy.preempts or not self.running:
            return None
        candidates = self.policy.preempt_candidates(req, list(self.running), ctx)
        ratio, ps, cap = self.new_token_ratio, self.page_size, self.max_model_len
        chosen: list[Request] = []
        pages = slots = 0
        for victim in candidates:
            if victim.status is not RequestStatus.RUNNING or any(v is victim for v in chosen):
                raise ValueError(
                    f"policy {self.policy.name!r} named {victim.rid!r} to preempt, "
                    "which is not a running request (or named it twice)"
                )
            chosen.append(victim)
            # at least what retracting it frees: its own pages, the floor of its reservation
            pages += self.kv.own_pages(victim.kv) + int(victim.future_tokens(cap) * ratio / ps)
            slots += 1
            if pages >= pages_short and slots >= slots_short:
                break
        else:
            return None
        for victim in chosen:
            self._retract(victim)
            self.total_preemptions += 1
        log.info(
            "preempted %s for %s (policy %s)",
            ", ".join(v.rid for v in chosen),
            req.rid,
            self.policy.name,
        )
        return chosen

    def _restore_swapped(self, req: Request) -> SwappedKV | None:
        """The swapped-out KV of ``req`` (re-admitted now), taken from the scheduler's keeping."""
        return self.swapped.pop(id(req), None) if self.swapped else None

    def _forget_preempted(self, req: Request) -> None:
        """``req`` left the engine: its swapped-out KV (if any) is dropped."""
        swapped = self.swapped.pop(id(req), None) if self.swapped else None
        if swapped is not None:
            assert self.kv.swap is not None
            self.kv.swap.drop(swapped)
        self.recompute_until.pop(id(req), None)

    def _count_computed(
        self, plan: BatchPlan, owners: dict[str, Request | None], swap_seconds: float
    ) -> None:
        """Tokens the step computed, those of them computed before (retracted and recomputed:
        the recompute tax), and the time its swap copies took."""
        self.total_computed_tokens += plan.num_tokens
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
            "recomputed_tokens": self.total_recomputed_tokens,
            "recompute_tax": self.total_recomputed_tokens / computed if computed else 0.0,
            "swap_seconds": self.swap_seconds,
        }
