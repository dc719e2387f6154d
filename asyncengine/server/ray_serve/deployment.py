"""RayDeployment: Ray (a small local instance, or a cluster joined) and the replicas' Serve app.

A local instance gets no dashboard, no HTTP proxy (the HTTP app runs in the serving process)
and a small object store, and is stopped with the server; a joined cluster is left running and
only our application is deleted from it. Ray Serve places the replicas (``replica_cpus`` and
``replica_gpus`` each: a fraction of a GPU shares one), health-checks them and replaces a
replica that dies.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from asyncengine.api.ray_local import init_ray
from asyncengine.common.config import EngineConfig
from asyncengine.routing import KVEventsRouter

log = logging.getLogger("asyncengine.server.ray")

DEFAULT_APP_NAME = "asyncengine"
ROUTING_STATS_PERIOD_SECONDS = 1.0  # how often each replica reports its stats to the routers
ROUTER_CLASS = "asyncengine.server.ray_serve.router:AsyncEngineRequestRouter"
# where each replica publishes its KV events for a kv-events router (a free port each); on a
# cluster of several nodes give --kv-events tcp://0.0.0.0:* (the router dials each node's IP)
LOCAL_KV_EVENTS = "tcp://127.0.0.1:*"
# Serve's own shutdown waits on Ray's processes: when a signal to the whole process group
# (Ctrl-C, timeout(1)) has taken them down, it would wait for ever.
SERVE_SHUTDOWN_TIMEOUT_SECONDS = 20.0


@dataclass(frozen=True, slots=True)
class RayOptions:
    replicas: int = 1
    address: str | None = None  # None: start a local Ray instance (and stop it at the end)
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    router: str = "cache-aware"
    router_options: dict[str, Any] = field(default_factory=dict)
    app_name: str = DEFAULT_APP_NAME

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError("--replica-cpus and --replica-gpus must be >= 0")


def replica_config(config: EngineConfig, options: RayOptions) -> EngineConfig:
    """The config each replica runs: a kv-events router has the replicas publish on free ports.
    ValueError for a fixed KV events endpoint that several replicas of a local instance would
    all bind (on a cluster, one replica per node can share a port)."""
    if options.router == KVEventsRouter.name and config.kv_events is None:
        return config.replace(kv_events=LOCAL_KV_EVENTS)
    endpoint = config.kv_events
    if (
        endpoint
        and options.replicas > 1
        and options.address is None
        and not endpoint.endswith(":*")
    ):
        raise ValueError(
            f"--kv-events {endpoint} would be bound by each of the {options.replicas} replicas "
            "on this machine: give a free port each, e.g. 'tcp://127.0.0.1:*'"
        )
    return config


def replica_deployment(config: EngineConfig, options: RayOptions) -> Any:
    """The Serve application of ``options.replicas`` EngineReplicas of ``config``."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from asyncengine.server.ray_serve.replica import EngineReplica

    config = replica_config(config, options)
    router_options = dict(options.router_options)
    if options.router == KVEventsRouter.name:  # the replicas publish, the router subscribes
        router_options.setdefault("page_size", config.page_size)
    router: dict[str, Any] = {
        "request_router_class": ROUTER_CLASS,
        "request_router_kwargs": {
            "app": options.app_name,
            "router": options.router,
            "options": router_options,
        },
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_SECONDS,
        "request_routing_stats_timeout_s": 5.0,
    }
    deployment: Any = serve.deployment(
        EngineReplica,
        name="AsyncEngineReplica",
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        # the engine queues and refuses (503) by itself: Ray Serve must not hold requests back
        max_ongoing_requests=config.max_running_requests + config.max_waiting_requests,
        health_check_period_s=2.0,
        graceful_shutdown_timeout_s=5.0,
        logging_config={"log_level": "WARNING", "enable_access_log": False},
        request_router_config=RequestRouterConfig(**router),
    )
    return deployment.bind(config)


class RayDeployment:
    """``open`` starts (or joins) Ray and deploys the replicas; ``close`` undoes what it did."""

    def __init__(self, options: RayOptions) -> None:
        self.options = options
        self._owns_ray = False
        self._deployed = False

    def open(self, config: EngineConfig) -> Any:
        """Block until every replica has loaded the model; return the deployment handle."""
        import ray
        from ray import serve

        options = self.options
        if not ray.is_initialized():
            cpus = max(os.cpu_count() or 1, math.ceil(options.replicas * options.replica_cpus))
            init_ray(options.address, num_cpus=cpus)
            self._owns_ray = True
        serve.start(proxy_location="Disabled")
        log.info(
            "deploying %d replica(s) of %s on Ray (%s), router %s",
            options.replicas,
            config.model,
            options.address or "local instance",
            options.router,
        )
        self._deployed = True
        return serve.run(
            replica_deployment(config, options), name=options.app_name, route_prefix=None
        )

    def close(self) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        app = self.options.app_name
        if self._owns_ray and self.options.address is None:
            remove = serve.shutdown
        elif self._deployed:
            remove = lambda: serve.delete(app)  # noqa: E731
        else:
            remove = None
        if remove is not None:
            worker = threading.Thread(target=remove, name="serve-shutdown", daemon=True)
            worker.start()
            worker.join(SERVE_SHUTDOWN_TIMEOUT_SECONDS)
            if worker.is_alive():
                log.warning(
                    "Ray Serve did not shut down in %.0fs; leaving it",
                    SERVE_SHUTDOWN_TIMEOUT_SECONDS,
                )
        self._deployed = False
        if self._owns_ray:
            ray.shutdown()
