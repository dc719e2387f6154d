"""/metrics of the replicas: each engine's series with a ``replica`` label, and the router's.

The engine counters and gauges are those a single server exports (server/prometheus.py), with
the scheduler's unlabelled counters and its admission blocks by reason
(server/scheduling_metrics.py; not the tenants', the eviction rules' or the shadow policy's), read
from each replica's last routing-stats report (Ray Serve polls every replica every
``ROUTING_STATS_PERIOD_SECONDS``), so a scrape sends nothing to the replicas. The router adds
its decisions by reason (prefix, load_guard, least_cached, round_robin, least_loaded) and the
size of its prefix tree.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from asyncengine.server.prometheus import ENGINE_COUNTERS, ENGINE_GAUGES, PREFIX, ServerMetrics
from asyncengine.server.ray_serve.remote_engine import RemoteEngine
from asyncengine.server.ray_serve.replica import ADMISSION_BLOCKED
from asyncengine.server.scheduling_metrics import SCALAR_COUNTERS


def admission_blocked(per_replica: dict[str, dict[str, Any]]) -> Metric:
    """Each replica's admission blocks by reason (replica.reported_stats flattens them)."""
    family = CounterMetricFamily(
        f"{PREFIX}_admission_blocked",
        "Steps whose admission of waiting requests stopped, by reason",
        labels=["replica", "reason"],
    )
    prefix = f"{ADMISSION_BLOCKED}:"
    for replica, stats in sorted(per_replica.items()):
        for key, value in sorted(stats.items()):
            if key.startswith(prefix):
                family.add_metric([replica, key.removeprefix(prefix)], float(value))
    return family


class ReplicaCollector(Collector):
    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        per_replica = self.engine.replica_stats()
        for name, (key, doc) in {**ENGINE_COUNTERS, **SCALAR_COUNTERS}.items():
            counter = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["replica"])
            for replica, stats in sorted(per_replica.items()):
                if isinstance(stats.get(key), (int, float)):
                    counter.add_metric([replica], float(stats[key]))
            yield counter
        yield admission_blocked(per_replica)
        for name, (key, doc) in ENGINE_GAUGES.items():
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["replica"])
            for replica, stats in sorted(per_replica.items()):
                if isinstance(stats.get(key), (int, float)):
                    gauge.add_metric([replica], float(stats[key]))
            yield gauge
        yield GaugeMetricFamily(
            f"{PREFIX}_replicas", "Replicas serving", value=float(len(per_replica))
        )
        router = self.engine.router()
        if router is None:  # made by Ray Serve at the first call through the handle
            return
        decisions = CounterMetricFamily(
            f"{PREFIX}_router_decisions",
            "Requests routed, by router and reason (prefix, load_guard, least_cached, ...)",
            labels=["router", "reason"],
        )
        for reason, count in sorted(router.decisions().items()):
            decisions.add_metric([router.policy.name, reason], float(count))
        yield decisions
        tree = router.tree_stats()
        if tree:
            if "nodes" in tree:  # the kv-events router keeps pages, not a tree
                yield GaugeMetricFamily(
                    f"{PREFIX}_router_tree_nodes",
                    "Nodes of the router's prefix tree",
                    value=tree["nodes"],
                )
            tokens = GaugeMetricFamily(
                f"{PREFIX}_router_tree_tokens",
                "Prompt tokens the router's prefix tree holds for each replica",
                labels=["replica"],
            )
            for key, value in sorted(tree.items()):
                if key.startswith("tokens:"):
                    tokens.add_metric([key.removeprefix("tokens:")], float(value))
            yield tokens

    def describe(self) -> Iterator[Metric]:
        return iter(())


def replica_metrics(engine: RemoteEngine) -> ServerMetrics:
    """The server's own request metrics plus the replicas' and the router's series."""
    metrics = ServerMetrics()
    metrics.registry.register(ReplicaCollector(engine))
    return metrics
