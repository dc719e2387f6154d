"""Bounds for clients that connect and then stop: requests served at once, and how long a
response may wait for its client to read it.

- More than ``max_requests`` requests in the server at once (streams included, until their
  last byte is sent): the next is answered 503 at once and its connection closed. Probes
  (GET /health and GET /metrics) get ``PROBE_REQUESTS`` more, so a flood of stalled clients
  does not fail a liveness probe (an orchestrator would restart the server), nor can probes
  grow the flood.
- A response the client does not read for ``write_timeout`` seconds (a stream whose client
  stopped reading, a large body) ends: its connection is dropped, which aborts its engine
  request. Whole bodies are sent here, inside the limit, so their writes are bounded too.
- Idle keep-alive connections close after the server's idle timeout (aiohttp's
  ``keepalive_timeout``, set by ``start_http``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass

from aiohttp import web

from asyncengine.server.errors import ApiError, Handler

log = logging.getLogger("asyncengine.server")

DEFAULT_WRITE_TIMEOUT_SECONDS = 30.0
DEFAULT_IDLE_TIMEOUT_SECONDS = 75.0
# requests beyond what the engine can hold (its waiting queue and running batch), for probes
SPARE_REQUESTS = 64
# probes served beyond max_requests (a few scrapers and orchestrators probing at once)
PROBE_REQUESTS = 4
PROBE_PATHS = frozenset({"/health", "/metrics"})


def default_max_requests(max_waiting_requests: int, max_running_requests: int) -> int:
    """As many requests as the engine can queue and run, and a few more: a limit only a flood
    of connections that send nothing, or read nothing, reaches."""
    return max_waiting_requests + max_running_requests + SPARE_REQUESTS


@dataclass(slots=True)
class ConnectionLimits:
    max_requests: int
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_SECONDS
    active: int = 0

    def __post_init__(self) -> None:
        if self.max_requests < 1:
            raise ValueError("max_connections must be >= 1")
        if self.write_timeout <= 0:
            raise ValueError("write_timeout must be > 0")


LIMITS = web.AppKey("asyncengine_connection_limits", ConnectionLimits)


class WriteTimeoutError(ConnectionError):
    """The client did not read what was written to it in time."""


async def write_within(request: web.Request, timeout: float, write: Awaitable[None]) -> None:
    """Await ``write`` (a response write) for at most ``timeout`` seconds; past it the
    connection is dropped and ``WriteTimeoutError`` raised."""
    try:
        await asyncio.wait_for(write, timeout)
    except asyncio.TimeoutError:
        log.info(
            "dropped a connection from %s: its client read nothing for %gs",
            request.remote,
            timeout,
        )
        if request.transport is not None:
            request.transport.abort()
        raise WriteTimeoutError(f"the client read nothing for {timeout:g}s") from None


async def _send(request: web.Request, response: web.StreamResponse) -> None:
    await response.prepare(request)
    await response.write_eof()


@web.middleware
async def connection_limit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    limits = request.app.get(LIMITS)
    if limits is None:
        return await handler(request)
    probe = request.method == "GET" and request.path in PROBE_PATHS
    if limits.active >= limits.max_requests + (PROBE_REQUESTS if probe else 0):
        return ApiError(
            503,
            f"the server is serving its limit of {limits.max_requests} requests at once "
            "(max_connections); retry later",
            type="server_overloaded",
            code="too_many_connections",
            headers={"Retry-After": "1"},
            close_connection=True,
        ).response()
    limits.active += 1
    try:
        response = await handler(request)
        if not response.prepared:
            try:
                await write_within(request, limits.write_timeout, _send(request, response))
            except (WriteTimeoutError, ConnectionError):
                pass  # the connection is gone; aiohttp finds it closed
        return response
    finally:
        limits.active -= 1
