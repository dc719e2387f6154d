"""Prometheus series of the scheduler's research counters, read from ``engine.stats()`` at
scrape time (the server's metrics collector yields them):

- ``asyncengine_admission_blocked_total{reason}``: steps whose admission stopped for ``reason``
  (asyncengine/scheduler/admission.py lists the reasons);
- ``asyncengine_preemptions_total``: running requests retracted for a better-priority one;
- ``asyncengine_request_timeouts_total``: requests ended by their timeout or max_queue_time;
- ``asyncengine_policy_swaps_total``: live policy changes (a failed policy's hand-over to FCFS
  is one);
- ``asyncengine_policy_failures_total``: policy hooks that raised, answered what cannot be, or
  stalled the engine (each hands over to FCFS: scheduler/policy_guard.py);
- ``asyncengine_policy_idle_holds_total`` and ``..._policy_idle_seconds_total``: steps that
  ran nothing because the policy held every waiting request while nothing ran, and the
  seconds the engine so sat idle (scheduler/policy_guard.py);
- ``asyncengine_tenant_{requests,prompt_tokens,generation_tokens}_total{tenant}``: the label
  is ``tenant_label(name)``, a hash of the client's ``user`` string (a scrape must not list
  other clients' names; the operator hashes a name to find its series), "" for requests without
  one and "_other" for those past the cap on tenants (tenant_stats.py);
- ``asyncengine_eviction_{evictions,evicted_tokens,recomputed_tokens,hit_tokens}_total{rule}``:
  prefix-cache evictions (leaves), tokens evicted, tokens computed again after an eviction had
  dropped them, and prefix-cache hit tokens, by the eviction rule in charge when they happened;
- ``asyncengine_shadow_decisions_total``, ``..._shadow_first_pick_agreements_total`` and
  ``..._shadow_top_k_same_total`` with the gauges ``asyncengine_shadow_first_pick_agreement``
  and ``asyncengine_shadow_top_k_agreement`` (means over the decisions), labelled with the
  shadow policy, when there is one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from asyncengine.core.tenant_stats import NO_TENANT, OTHER

PREFIX = "asyncengine"

SCALAR_COUNTERS: dict[str, tuple[str, str]] = {
    "preemptions": ("preemptions", "Running requests retracted for a better-priority request"),
    "request_timeouts": ("finished_timeout", "Requests ended by their timeout or max_queue_time"),
    "policy_swaps": (
        "policy_swaps",
        "Live scheduling policy changes (a failed policy's hand-over to FCFS is one)",
    ),
    "policy_failures": (
        "policy_failures",
        "Policy hooks that raised, answered what cannot be or stalled (FCFS took over)",
    ),
    "policy_idle_holds": (
        "policy_idle_holds",
        "Steps that ran nothing: the policy held every waiting request while nothing ran",
    ),
    "policy_idle_seconds": (
        "policy_idle_seconds",
        "Seconds the engine sat idle because the policy held every waiting request",
    ),
}

TENANT_COUNTERS: dict[str, tuple[str, str]] = {
    "tenant_requests": ("requests", "Requests accepted, by tenant"),
    "tenant_prompt_tokens": ("prompt_tokens", "Prompt tokens of accepted requests, by tenant"),
    "tenant_generation_tokens": ("generated_tokens", "Tokens generated, by tenant"),
}


EVICTION_COUNTERS: dict[str, tuple[str, str]] = {
    "eviction_evictions": ("evictions", "Prefix-cache leaves evicted, by eviction rule"),
    "eviction_evicted_tokens": ("evicted_tokens", "Prefix-cache tokens evicted, by rule"),
    "eviction_recomputed_tokens": (
        "evicted_recomputed_tokens",
        "Tokens computed again because an eviction had dropped them, by eviction rule",
    ),
    "eviction_hit_tokens": ("hit_tokens", "Prompt tokens served from the prefix cache, by rule"),
}


def tenant_label(tenant: str) -> str:
    """The metrics label of a tenant: ``t-`` and 12 hex digits of its SHA-256."""
    if tenant in (NO_TENANT, OTHER):
        return tenant
    return "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:12]


def scheduling_families(stats: Mapping[str, Any]) -> Iterator[Metric]:
    blocked = stats.get("admission_blocked")
    if isinstance(blocked, dict):
        family = CounterMetricFamily(
            f"{PREFIX}_admission_blocked",
            "Steps whose admission of waiting requests stopped, by reason",
            labels=["reason"],
        )
        for reason, count in blocked.items():
            family.add_metric([reason], float(count))
        yield family
    for name, (key, doc) in SCALAR_COUNTERS.items():
        value = stats.get(key)
        if isinstance(value, (int, float)):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
    by_rule = stats.get("eviction_by_rule")
    if isinstance(by_rule, dict) and by_rule:
        for name, (key, doc) in EVICTION_COUNTERS.items():
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["rule"])
            for rule, row in by_rule.items():
                family.add_metric([str(rule)], float(row.get(key, 0)))
            yield family
    tenants = stats.get("tenants")
    if isinstance(tenants, dict) and tenants:
        for name, (key, doc) in TENANT_COUNTERS.items():
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["tenant"])
            for tenant, row in tenants.items():
                family.add_metric([tenant_label(tenant)], float(row.get(key, 0)))
            yield family
    shadow = stats.get("shadow")
    if isinstance(shadow, dict):
        label = [str(shadow["policy"])]
        for name, key, doc in (
            ("shadow_decisions", "decisions", "Steps the shadow policy ordered the queue"),
            ("shadow_first_pick_agreements", "first_pick_agree", "Shadow's first pick agreed"),
            ("shadow_top_k_same", "top_k_same", "Shadow's top-k was the live policy's top-k"),
        ):
            counter = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["shadow"])
            counter.add_metric(label, float(shadow[key]))
            yield counter
        for name, key, doc in (
            (
                "shadow_first_pick_agreement",
                "first_pick_agreement",
                "Share of agreeing first picks",
            ),
            ("shadow_top_k_agreement", "top_k_agreement", "Mean overlap of the top-k"),
        ):
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["shadow"])
            gauge.add_metric(label, float(shadow[key]))
            yield gauge
