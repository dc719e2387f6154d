"""The policy interface: order the waiting queue and budget each step. Policies never touch KV."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncengine.policies.victims import order_victims
from asyncengine.speculative.rules import rule_guesses
from asyncengine.speculative.settings import SpeculativeConfig

if TYPE_CHECKING:
    from asyncengine.common.plan import BatchPlan
    from asyncengine.common.request import Request


class SchedulingConfig(Protocol):
    """The engine settings a policy reads (``EngineConfig`` has them; a policy reads them
    through this protocol and does not depend on the config module)."""

    @property
    def page_size(self) -> int: ...

    @property
    def max_prefill_tokens(self) -> int: ...

    @property
    def chunked_prefill_size(self) -> int: ...

    @property
    def max_running_requests(self) -> int: ...

    @property
    def preemption_victim(self) -> str: ...


@dataclass(slots=True)
class StepBudget:
    """Token limits for one step. ``chunk_size`` 0 means: do not split prompts."""

    prefill_tokens: int
    total_tokens: int | None  # prefill + decode tokens together; None: no joint limit
    chunk_size: int


@dataclass(slots=True)
class PolicyContext:
    """What a policy may look at when it decides. Read-only by convention."""

    config: SchedulingConfig
    now: float
    num_running: int
    num_decodes: int  # decode tokens already in this step
    prefix_len: Callable[[Sequence[int]], int]  # cached prefix length of a token sequence
    chunked: Request | None  # the request mid-chunk, if any
    speculation: SpeculativeConfig | None = None  # speculative decoding's settings (None: off)
    # output tokens the engine's length predictor expects of a request (length_predictor)
    predicted_len: Callable[[Request], float] = lambda req: float(req.params.max_new_tokens)
    # a count that changes whenever ``prefix_len(ids)`` may have grown (a prefix it could match
    # was cached): a policy may keep an answer of 0 while it stays the same. None: keep nothing
    prefix_epoch: Callable[[Sequence[int]], int] | None = None
    # the same for every sequence at once: while it stays the same no ``prefix_len`` grew
    cache_epoch: int | None = None
    # the LoRA adapters the step already holds (running and mid-prompt requests'; a request's
    # own is ``req.lora``): one of them joins without taking one of ``max_loras`` slots
    step_loras: Callable[[], Collection[str]] = lambda: ()
    # ``cached_prefix``'s answers, kept per waiting request by the scheduler (None: ask
    # ``prefix_len`` each time)
    kept_prefix_len: Callable[[Request], int] | None = None

    def cached_prefix(self, req: Request) -> int:
        """The tokens of waiting ``req``'s ``cache_ids`` its admission would take from the
        prefix cache now: ``prefix_len(req.cache_ids)``, or fewer where it may not take them
        all (a mean-pooled embedding, prompt scores to compute). The scheduler keeps each
        waiting request's answer and checks it instead of walking the tree again while the
        cache under it is unchanged: asked every step, it costs the same for a long context."""
        if self.kept_prefix_len is None:
            return self.prefix_len(req.cache_ids)
        return self.kept_prefix_len(req)


class Policy:
    """Base policy: arrival order, the config's budgets. Subclass and override what you need.

    ``order`` returns the waiting requests in the order the scheduler should try to admit them;
    a request it leaves out is held this step (counted as an admission block, "policy_hold").
    ``budget`` returns this step's token limits. ``observe`` receives every finished step with
    its measured forward time (policies that learn from latency use it). ``finished`` hears of
    every request that leaves the engine. ``preempt_candidates`` names running requests the
    scheduler may retract for a blocked waiting one (only when ``preempts`` is true), and, asked
    with no candidate, the order in which running requests go when KV memory runs short.
    ``speculate`` says how many tokens a decoding request may guess this step (speculative
    decoding on; 0: none): by default the configured rule's answer (speculative/rules.py).
    ``wake_time`` says, when the policy holds back every waiting request while nothing runs
    (a batching window, pacing), the clock time at which it may admit one: the engine sleeps
    until then and the simulator moves its clock there, instead of polling (an arrival still
    comes first; None: it does not say).
    """

    name = "base"  # a subclass that sets none is called by its class name
    # True when the subclass overrides ``order`` / ``budget``; a subclass that defines the hook
    # and sets no flag gets it set, so a composition never drops a hook it was written with
    orders = False
    budgets = False
    preempts = False  # True when ``preempt_candidates`` may name requests to retract
    # False when ``observe`` ignores a plan's decode segments and no hook reads a running
    # request's progress (its output, KV length): the simulator may then count decodes in
    # bulk instead of writing them step by step (sim/bulk_decode.py), with the same results
    sees_decodes = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__
        if "order" in cls.__dict__ and "orders" not in cls.__dict__:
            cls.orders = True
        if "budget" in cls.__dict__ and "budgets" not in cls.__dict__:
            cls.budgets = True

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f"policy {self.name!r} takes no options, got {sorted(options)}")

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return waiting

    def candidates(self, waiting: Sequence[Request], size: int) -> list[Request]:
        """The waiting requests ``order`` is given this step: the ``size`` oldest
        (``policy_window``), which bounds each step's ordering cost on a long queue. A policy
        may add requests from past the window (``fair``: a window per tenant). ``waiting`` is
        the queue in admission order, read-only (the scheduler's ``WaitingQueue``: iteration,
        ``len``, ``waiting[0]`` and ``waiting[:n]`` are cheap; other indexes walk the queue).
        Return a new list: admission removes from the queue while it goes through it."""
        return list(waiting[:size])  # the queue's slice from its head is a quick copy

    def budget(self, ctx: PolicyContext) -> StepBudget:
        return StepBudget(
            prefill_tokens=ctx.config.max_prefill_tokens,
            total_tokens=None,
            chunk_size=ctx.config.chunked_prefill_size,
        )

    def observe(self, plan: BatchPlan, seconds: float) -> None:
        return None

    def speculate(self, req: Request, ctx: PolicyContext) -> int:
        """Most guessed tokens ``req`` verifies this step (0: it decodes one token). The
        scheduler asks only when speculation is configured; the proposer may find fewer."""
        if ctx.speculation is None:
            return 0
        return rule_guesses(ctx.speculation, req, ctx.num_running)

    def finished(self, req: Request) -> None:
        """``req`` left the engine (finished, aborted or timed out)."""
        return None

    def wake_time(self, ctx: PolicyContext) -> float | None:
        """Asked when the policy admitted nothing, requests wait and nothing runs: the clock
        time (``ctx.now``'s clock) at which it may admit one; None: it does not say (the
        engine and the simulator then ask again every ``IDLE_POLL_SECONDS``)."""
        return None

    def preempt_candidates(
        self, candidate: Request | None, running: Sequence[Request], ctx: PolicyContext
    ) -> list[Request]:
        """Running (decoding) requests the scheduler may retract, in this order, to admit
        ``candidate`` when KV memory or the running-request cap blocks it.

        The scheduler retracts the shortest prefix of the list that makes room, and none when
        the whole list would not; a retracted request is recomputed later (its computed prefix
        stays cached) or swapped back in (``preemption_mode``), and never emits a token twice.
        Policies never free KV themselves.

        ``candidate`` None: the running requests' next tokens do not fit in KV memory and some
        must go; the scheduler retracts from the front of the list until the rest fit (those
        left out go last, in the config's order). The default is the config's
        ``preemption_victim`` rule (policies/victims.py).
        """
        if candidate is None:
            return order_victims(ctx.config.preemption_victim, running)
        return []


def take_options(name: str, options: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """Merge ``options`` over ``defaults``; an unknown option raises naming it and the known ones."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"policy {name!r}: unknown option(s) {unknown}; known: {sorted(defaults)}")
    merged = dict(defaults)
    for key, value in options.items():
        expected = type(defaults[key])
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or isinstance(value, bool) != isinstance(
            defaults[key], bool
        ):
            raise ValueError(
                f"policy {name!r}: option {key!r} must be {expected.__name__}, got {value!r}"
            )
        merged[key] = value
    return merged
