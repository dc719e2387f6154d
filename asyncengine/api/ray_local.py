"""A small local Ray instance (or a cluster joined) for the replicas and the simulator sweeps.

Small: no dashboard, a modest object store (requests, deltas and workloads are small), Ray's
logs at WARNING. Ray gives its processes 30 s to register at start-up; on a loaded machine
that can pass, so a local start that times out is cleaned up and tried again once.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("asyncengine.ray")

LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024
START_ATTEMPTS = 2


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    object_store_bytes: int = LOCAL_OBJECT_STORE_BYTES,
) -> None:
    """Connect to the cluster at ``address``, or start a local instance (``num_cpus``: the
    machine's by default)."""
    import ray

    if address is not None:
        ray.init(address=address, logging_level=logging.WARNING)
        return
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(
                num_cpus=num_cpus or os.cpu_count() or 1,
                object_store_memory=object_store_bytes,
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
            return
        except Exception as exc:  # Ray raises a bare Exception when its node does not register
            ray.shutdown()
            if attempt == START_ATTEMPTS or "timed out during startup" not in str(exc):
                raise
            log.warning("the local Ray instance did not start in time (%s); trying again", exc)
