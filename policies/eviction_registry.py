"""Eviction rules by name (``eviction_policy``): the built-ins, "package.module:Class" and
"path/to/file.py:Class" (a subclass of asyncengine.cache.eviction_rule.EvictionRule), with the
policies' loader and the same rule for live swaps: a request names only a built-in or what the
operator listed at start-up (``allowed_eviction_policies``), never a file or module to load."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncengine.cache.eviction_rule import EvictionRule, LeastRecentlyUsed
from asyncengine.common.config import ConfigError
from asyncengine.policies.eviction_arc import AdaptiveReplacement
from asyncengine.policies.eviction_cost_aware import CostAware
from asyncengine.policies.eviction_lfu import LeastFrequentlyUsed
from asyncengine.policies.eviction_queue_aware import QueueAware
from asyncengine.policies.plugin_loader import build_plugin, failed_build_key, resolve_plugin

EVICTION_RULES: dict[str, type[EvictionRule]] = {
    cls.name: cls
    for cls in (LeastRecentlyUsed, LeastFrequentlyUsed, AdaptiveReplacement, QueueAware, CostAware)
}
KIND = "eviction policy"


def resolve_eviction_rule(spec: str) -> type[EvictionRule]:
    return resolve_plugin(spec, EvictionRule, EVICTION_RULES, KIND)


def make_eviction_rule(spec: str, options: dict[str, Any] | None = None) -> EvictionRule:
    """The rule ``spec`` names, built with ``options``; ValueError/TypeError when either is bad
    (whatever a plug-in's constructor raises comes back as a ValueError naming it)."""
    return build_plugin(resolve_eviction_rule(spec), spec, options or {}, EVICTION_RULES, KIND)


def build_eviction_rule(
    spec: str, options: dict[str, Any] | None = None, key: str = "eviction_policy"
) -> EvictionRule:
    """``make_eviction_rule`` for a config: ConfigError naming the key of what is wrong."""
    try:
        cls = resolve_eviction_rule(spec)
    except ValueError as exc:
        raise ConfigError(f"config key {key!r} = {spec!r}: {exc}") from None
    try:
        return build_plugin(cls, spec, options or {}, EVICTION_RULES, KIND)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config key {failed_build_key(key, spec, options)}: {exc}") from None


def listed_rule(spec: str, allowed: Sequence[str]) -> str:
    """The entry of ``allowed`` whose rule is named ``spec`` (not a built-in's name), else
    ``spec``. The entries loaded at start-up; one that does not load names nothing here."""
    name = spec.strip()
    if ":" in name or name.lower().replace("_", "-") in EVICTION_RULES:
        return spec
    for entry in allowed:
        if ":" not in entry:
            continue
        try:
            if resolve_eviction_rule(entry.strip()).name == name:
                return entry.strip()
        except ValueError:  # the start-up check says why
            continue
    return spec


def check_live_eviction_rule(spec: str, allowed: Sequence[str]) -> str:
    """The spec to swap in for ``spec``: a built-in name, an entry of ``allowed`` (loaded at
    start-up, with the rule the engine started with), or a listed rule's name (its entry:
    ``listed_rule``); ValueError otherwise: an admin request never makes the engine load code."""
    name = listed_rule(spec, allowed).strip()
    if name in {entry.strip() for entry in allowed}:
        return name
    if name.lower().replace("_", "-") in EVICTION_RULES:
        return name
    what = "may not be swapped in live" if ":" in name else "is unknown"
    raise ValueError(
        f"{KIND} {spec!r} {what}: a live swap takes the built-ins "
        f"({', '.join(sorted(EVICTION_RULES))}); other rules must be listed at start-up "
        "(--allow-eviction-policy or 'allowed_eviction_policies')"
    )
