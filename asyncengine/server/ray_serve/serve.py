"""``asyncengine serve --replicas N``: the HTTP server in front of N replicas on Ray Serve.

Same paths, SSE format and errors as one engine (the same app serves both); /metrics gains a
``replica`` label and the router's counters. See deployment.py for what runs where.
"""

from __future__ import annotations

import argparse
from typing import Any

from asyncengine.api.event_loop import run
from asyncengine.common.config import EngineConfig, key_value
from asyncengine.routing import ROUTERS, make_router
from asyncengine.server.ray_serve import require_ray
from asyncengine.server.ray_serve.deployment import RayDeployment, RayOptions, replica_config


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas on Ray Serve (optional extra asyncengine[ray])")
    group.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas on Ray Serve behind one router (default: one engine here)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this Ray cluster (e.g. 10.0.0.1:6379) instead of starting a local instance",
    )
    group.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs per replica (default 1)"
    )
    group.add_argument(
        "--replica-gpus",
        type=float,
        default=0.0,
        help="GPUs per replica; 0.5 puts two replicas on one GPU (default 0)",
    )
    group.add_argument(
        "--router",
        choices=sorted(ROUTERS),
        default="cache-aware",
        help="how requests are spread over the replicas (default cache-aware)",
    )
    group.add_argument(
        "--router-option",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="router setting, e.g. cache_threshold=0.5 or balance_abs_threshold=16 (repeatable)",
    )


def uses_ray(args: argparse.Namespace) -> bool:
    return args.replicas is not None or args.ray_address is not None


def ray_options(args: argparse.Namespace) -> RayOptions:
    options = RayOptions(
        replicas=1 if args.replicas is None else args.replicas,  # --ray-address alone: 1
        address=args.ray_address,
        replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus,
        router=args.router,
        router_options=dict(args.router_option),
    )
    make_router(options.router, **options.router_options)  # a bad option fails before Ray starts
    return options


async def run_replica_server(config: EngineConfig, handle: Any, app_name: str, **http: Any) -> int:
    """Serve HTTP in front of a deployed application until SIGINT/SIGTERM."""
    from asyncengine.server.ray_serve.metrics import replica_metrics
    from asyncengine.server.ray_serve.remote_engine import RemoteEngine
    from asyncengine.server.serve import run_server

    engine = RemoteEngine(config, handle, app_name)
    await engine.start()
    return await run_server(config, engine=engine, metrics=replica_metrics(engine), **http)


def serve_replicas(config: EngineConfig, args: argparse.Namespace) -> int:
    """The CLI's entry: Ray up, replicas deployed, HTTP served, everything torn down."""
    from asyncengine.core.builder import make_policies
    from asyncengine.executor.loader import tokenizer_dir
    from asyncengine.server.connection_limits import raise_open_files_limit
    from asyncengine.server.port import check_port_free
    from asyncengine.server.serve import http_options

    require_ray()
    raise_open_files_limit()  # before Ray starts: its processes inherit it
    check_port_free(args.host, args.port)  # before Ray starts and the replicas load the model
    options = ray_options(args)
    tokenizer_dir(config.model)  # a bad model fails here, before Ray starts
    make_policies(config)  # and a bad policy or option
    replica_config(config, options)  # and what the replicas cannot all run
    deployment = RayDeployment(options)
    try:
        handle = deployment.open(config)
        return run(run_replica_server(config, handle, options.app_name, **http_options(args)))
    finally:
        deployment.close()
