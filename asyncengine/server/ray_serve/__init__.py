"""Data-parallel serving on Ray Serve: N AsyncEngine replicas behind our replica router.

``asyncengine serve --replicas N`` (serve.py here) keeps the HTTP app of a single engine in
the serving process and gives it a RemoteEngine (remote_engine.py) whose requests go through a
Ray Serve DeploymentHandle to EngineReplica actors (replica.py); the handle's RequestRouter
(router.py) runs one of asyncengine.routing's routers in this process. Ray comes with the
optional extra ``asyncengine[ray]``.
"""

from __future__ import annotations

INSTALL_HINT = "serving replicas on Ray needs Ray Serve: pip install 'asyncengine[ray]'"


def require_ray() -> None:
    """Raise a clear error when Ray Serve is not installed."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"{INSTALL_HINT} ({exc})") from None
