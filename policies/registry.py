"""Policies by name: built-ins, "ordering+budget" compositions, "package.module:Class" (an
importable module) and "path/to/file.py:Class" (a file anywhere, no PYTHONPATH needed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncengine.common.config import ConfigError
from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext, StepBudget
from asyncengine.policies.dfs_weight import DFSWeightPolicy
from asyncengine.policies.dynamic_chunking import DynamicChunkingPolicy
from asyncengine.policies.fair import FairPolicy
from asyncengine.policies.fcfs import FCFSPolicy
from asyncengine.policies.lora_fair import LoraFairPolicy
from asyncengine.policies.lpm import LPMPolicy
from asyncengine.policies.ltr import LTRPolicy
from asyncengine.policies.plugin_loader import build_plugin, failed_build_key, resolve_plugin
from asyncengine.policies.priority import PriorityPolicy
from asyncengine.policies.sjf import SJFPolicy
from asyncengine.policies.slo import SLOPolicy
from asyncengine.policies.token_budget import TokenBudgetPolicy

BUILTIN: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        FCFSPolicy,
        LPMPolicy,
        DFSWeightPolicy,
        TokenBudgetPolicy,
        DynamicChunkingPolicy,
        PriorityPolicy,
        SJFPolicy,
        LTRPolicy,
        FairPolicy,
        SLOPolicy,
        LoraFairPolicy,
    )
}


class ComposedPolicy(Policy):
    """Ordering (and preemption) from the part that orders, budget from the last part that
    budgets; every part observes every step and hears of every finished request."""

    def __init__(self, parts: list[Policy]) -> None:
        self.parts = parts
        self.name = "+".join(p.name for p in parts)
        orderers = [p for p in parts if p.orders]
        budgeters = [p for p in parts if p.budgets]
        if len(orderers) > 1:
            raise ValueError(
                f"policy {self.name!r} names more than one ordering: {[p.name for p in orderers]}"
            )
        self.orderer = orderers[0] if orderers else None
        self.budgeter = budgeters[-1] if budgeters else None

    @property
    def orders(self) -> bool:  # type: ignore[override]
        return self.orderer is not None

    @property
    def budgets(self) -> bool:  # type: ignore[override]
        return self.budgeter is not None

    @property
    def preempts(self) -> bool:  # type: ignore[override]
        return self.orderer is not None and self.orderer.preempts

    @property
    def sees_decodes(self) -> bool:  # type: ignore[override]
        return any(part.sees_decodes for part in self.parts)

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return self.orderer.order(waiting, ctx) if self.orderer else waiting

    def candidates(self, waiting: Sequence[Request], size: int) -> list[Request]:
        if self.orderer is None:
            return Policy.candidates(self, waiting, size)
        return self.orderer.candidates(waiting, size)

    def budget(self, ctx: PolicyContext) -> StepBudget:
        return self.budgeter.budget(ctx) if self.budgeter else Policy.budget(self, ctx)

    def observe(self, plan: BatchPlan, seconds: float) -> None:
        for part in self.parts:
            part.observe(plan, seconds)

    def finished(self, req: Request) -> None:
        for part in self.parts:
            part.finished(req)

    def wake_time(self, ctx: PolicyContext) -> float | None:
        """The earliest time a part names (a part that holds may let go then)."""
        times = [t for t in (part.wake_time(ctx) for part in self.parts) if t is not None]
        return min(times) if times else None

    def preempt_candidates(
        self, candidate: Request | None, running: Sequence[Request], ctx: PolicyContext
    ) -> list[Request]:
        if candidate is None:  # KV shortage: the ordering part's choice, else the config's
            part = self.orderer if self.orderer is not None else Policy()
            return part.preempt_candidates(None, running, ctx)
        if self.orderer is None or not self.orderer.preempts:
            return []
        return self.orderer.preempt_candidates(candidate, running, ctx)


def _resolve(name: str) -> type[Policy]:
    return resolve_plugin(name, Policy, BUILTIN, "policy")


def policy_names(spec: str) -> list[str]:
    """The names ``spec`` composes with ``+``; ValueError for an empty spec or an empty part."""
    names = [n.strip() for n in spec.split("+")]
    if not spec.strip():
        raise ValueError("policy must not be empty")
    if not all(names):
        raise ValueError(f"policy {spec!r} has an empty part between its '+'s")
    return names


def resolve_policy(spec: str) -> list[type[Policy]]:
    """The classes ``spec`` names (one, or the parts of a composition); ValueError if none,
    if a name is unknown or cannot be imported, or if more than one part orders the queue."""
    names = policy_names(spec)
    classes = [_resolve(n) for n in names]
    orderers = [cls.name for cls in classes if cls.orders]
    if len(classes) > 1 and len(orderers) > 1:
        raise ValueError(f"policy {spec!r} names more than one ordering: {orderers}")
    return classes


def make_policy(spec: str, options: dict[str, Any] | None = None) -> Policy:
    """Build a policy from ``"lpm"``, ``"lpm+dynamic-chunking"`` or ``"pkg.mod:Class"``.

    ``options`` maps option names to values for a single policy, or policy names to option
    tables for a composition (``{"lpm": {...}, "dynamic-chunking": {...}}``).
    """
    options = dict(options or {})
    names = policy_names(spec)
    classes = resolve_policy(spec)
    if len(classes) == 1:
        return build_plugin(classes[0], names[0], options, BUILTIN, "policy")
    parts = []
    for name, cls in zip(names, classes, strict=True):
        own = options.pop(cls.name, None) or options.pop(name, None) or {}
        parts.append(build_plugin(cls, name, own, BUILTIN, "policy"))
    if options:
        raise ValueError(f"policy options {sorted(options)} match no part of {spec!r}")
    policy = ComposedPolicy(parts)
    if policy.orderer is None:
        policy.orderer = FCFSPolicy()
    return policy


def _builtin_key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _listed_aliases(allowed: Sequence[str]) -> dict[str, str]:
    """The class name of each plug-in part of the ``allowed`` entries, to that part."""
    aliases: dict[str, str] = {}
    for entry in allowed:
        for part in policy_names(entry):
            if _builtin_key(part) in BUILTIN or ":" not in part:
                continue
            try:
                aliases.setdefault(_resolve(part).name, part)
            except ValueError:
                continue
    return aliases


def listed_names(spec: str, allowed: Sequence[str]) -> str:
    """``spec`` with each ``+`` part that is the name of a policy listed in ``allowed`` (and
    not a built-in's) replaced by the listed entry: ``"mine"`` for ``"my_policy.py:Mine"``
    whose class is named ``mine``. The entries loaded at start-up; one that does not load
    names nothing here (the start-up check says why)."""
    aliases = _listed_aliases(allowed)
    names = policy_names(spec)
    return "+".join(aliases.get(n, n) if _builtin_key(n) not in BUILTIN else n for n in names)


def check_live_policy(spec: str, allowed: Sequence[str]) -> str:
    """The spec to swap in for ``spec`` (a listed policy's name gives its entry: see
    ``listed_names``); ValueError unless every ``+`` part is a built-in name, or the spec or
    the part is listed in ``allowed`` (the operator's start-up list, with the policy the engine
    started with, whose plugin files loaded then). A path or module named only by a request
    never loads, so that an admin request cannot run code."""
    listed = {entry.strip() for entry in allowed}
    if spec.strip() in listed:
        return spec
    spec = listed_names(spec, allowed)
    if spec in listed:
        return spec
    names = policy_names(spec)
    refused = [n for n in names if _builtin_key(n) not in BUILTIN and n not in listed]
    if refused:
        named = {part: name for name, part in _listed_aliases(sorted(listed)).items()}
        entries = [f"{e} (as {named[e]!r})" if e in named else e for e in sorted(listed)]
        extra = f"; listed at start-up: {', '.join(entries)}" if listed else ""
        what = "may not be swapped in live" if ":" in refused[0] else "is unknown"
        raise ValueError(
            f"policy {refused[0]!r} {what}: a live swap takes built-in "
            f"names ({', '.join(sorted(BUILTIN))}, composed with '+'){extra}; other policies "
            "must be listed at start-up (--allow-policy or 'allowed_policies')"
        )
    return spec


def build_policy(spec: str, options: dict[str, Any] | None = None, key: str = "policy") -> Policy:
    """``make_policy`` for a config: a bad name or option raises ConfigError naming the config
    key (``key``, or ``key + "_options"``)."""
    try:
        resolve_policy(spec)
    except ValueError as exc:
        raise ConfigError(f"config key {key!r} = {spec!r}: {exc}") from None
    try:
        return make_policy(spec, options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config key {failed_build_key(key, spec, options)}: {exc}") from None
