"""Bounds for clients that connect and then stop: open connections, requests served at once,
and how long a response may wait for its client to read it.

- More than ``max_open_connections`` TCP connections open at once (idle, half-sent or busy):
  the next is answered 503 and closed without being served, so that connections which send a
  few bytes and stop cannot use up the process's file descriptors (past them ``accept`` fails
  for everyone, probes included). A liveness probe must still answer there (an orchestrator
  restarts a server that fails it): ``PROBE_SLOTS`` connections past the cap are each given
  ``PROBE_SECONDS`` to send a whole ``GET /health`` head, and that one request is served (the
  app's own handler, middlewares and all) before the connection closes; any other first bytes,
  a longer head or a slower one get the 503. When the slots are full a new connection takes
  the place of the oldest still sending its head, so that idle connections cannot hold them.
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
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import msgspec
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
MAX_DEFAULT_OPEN_CONNECTIONS = 4096
# descriptors kept for the rest of the process (model files, logs, the engine's pipes)
FD_MARGIN = 256
# the soft open-files limit a server asks for at start (vLLM asks for 65535): room for every
# open connection the default cap allows and for a larger --max-open-connections
OPEN_FILES_TARGET = 65536


def raise_open_files_limit(target: int = OPEN_FILES_TARGET) -> int:
    """Raise the soft limit on open files to the hard limit, at most ``target`` (many hosts
    start processes at 1024, far below their hard limit; vLLM and Ray raise it too); never
    lowers it. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:  # a platform cap below the hard limit (macOS)
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, want, exc)
            return soft
        log.info("raised the open-files limit from %d to %d (hard limit %s)", soft, want, hard)
        return want
    log.debug("open-files limit %s (hard limit %s) left as it is", soft, hard)
    return soft


def default_max_open_connections() -> int:
    """At most ``MAX_DEFAULT_OPEN_CONNECTIONS``, and ``FD_MARGIN`` (or half) below the soft
    limit on open files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_DEFAULT_OPEN_CONNECTIONS
    return max(1, min(MAX_DEFAULT_OPEN_CONNECTIONS, max(soft // 2, soft - FD_MARGIN)))


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


# the answer to a connection past the cap, written before its request is read
_REFUSAL_BODY = msgspec.json.encode(
    ApiError(
        503,
        "the server holds its limit of open connections (max_open_connections); retry later",
        type="server_overloaded",
        code="too_many_open_connections",
    ).body()
)
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
    % (len(_REFUSAL_BODY), _REFUSAL_BODY)
)


# the connections past the cap that may each send one GET /health (a few probers at once)
PROBE_SLOTS = 4
# how long such a connection has to send its head, and then to be answered, before it closes
PROBE_SECONDS = 1.0
PROBE_HEAD = b"GET /health HTTP/1."
PROBE_HEAD_BYTES = 8192  # aiohttp's own bound on a request head


def _probe_head_state(head: bytearray, new: int) -> bool | None:
    """Whether ``head`` (the bytes a connection past the cap sent so far, the last ``new`` of
    them just come) is one whole GET /health head and nothing more (True), can still become
    one (None), or cannot (False). Only the new bytes are searched: a head sent a byte at a
    time costs its length, not its square."""
    if len(head) > PROBE_HEAD_BYTES:
        return False
    checked = len(head) - new  # the bytes before were a start of a probe's head
    if checked < len(PROBE_HEAD) and not PROBE_HEAD.startswith(head[: len(PROBE_HEAD)]):
        return False
    end = head.find(b"\r\n\r\n", max(0, len(head) - new - 3))
    if end < 0:
        return None
    return end + 4 == len(head)  # no body, no second request after it


class OpenConnections:
    """The listening socket's protocol factory: each connection gets a protocol of ``factory``
    (aiohttp's ``runner.server``) while fewer than ``limit`` are open; past it the connection
    may take a probe slot (one GET /health), else it is answered ``REFUSAL`` and closed, and
    ``on_refused`` called."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        limit: int,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        if limit < 1:
            raise ValueError("max_open_connections must be >= 1")
        self.factory = factory
        self.limit = limit
        self.on_refused = on_refused
        self.open = 0
        self.refused = 0
        # the connections past the cap in a probe slot, oldest first
        self.probes: list[_CappedConnection] = []

    def __call__(self) -> asyncio.Protocol:
        return _CappedConnection(self)

    def admit(
        self, connection: _CappedConnection, transport: asyncio.BaseTransport
    ) -> asyncio.Protocol | None:
        """The protocol that serves ``connection``; None when it takes a probe slot (it is
        served once its head shows a probe) or is refused (and closed)."""
        if self.open < self.limit:
            self.open += 1
            return self.factory()
        if len(self.probes) >= PROBE_SLOTS:
            unsent = [probe for probe in self.probes if probe.head is not None]
            if not unsent:
                self.refuse(transport)
                return None
            unsent[0].give_up()  # the oldest that has not sent its head gives way
        self.probes.append(connection)
        connection.probe()
        return None

    def refuse(self, transport: asyncio.BaseTransport) -> None:
        """Answer ``REFUSAL`` and close."""
        if self.refused == 0:
            log.warning(
                "%d connections are open (max_open_connections): further ones are "
                "answered 503 and closed until some close (a GET /health excepted)",
                self.open,
            )
        self.refused += 1
        self.on_refused()
        # uvloop's transports are not asyncio.Transport subclasses, hence a cast
        writer = cast(asyncio.Transport, transport)
        writer.write(REFUSAL)
        writer.close()  # sends what was written, then closes


class _CappedConnection(asyncio.Protocol):
    """Counts one connection in its ``OpenConnections`` and hands every event to the protocol
    that serves it (none when refused, nor while it is a probe slot's and sending its head).
    Counted from ``connection_made`` on: a factory call whose connection never opens holds
    nothing."""

    __slots__ = ("_cap", "_counted", "_inner", "_timer", "head", "transport")

    def __init__(self, cap: OpenConnections) -> None:
        self._cap = cap
        self._inner: asyncio.Protocol | None = None
        self._counted = False  # in the cap's open connections (not a probe slot's)
        self._timer: asyncio.TimerHandle | None = None
        self.head: bytearray | None = None  # a probe slot's bytes until its head is whole
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self._inner = self._cap.admit(self, transport)
        self._counted = self._inner is not None
        if self._inner is not None:
            self._inner.connection_made(transport)

    def probe(self) -> None:
        """Take a probe slot: wait ``PROBE_SECONDS`` for a GET /health head."""
        self.head = bytearray()
        self._timer = asyncio.get_running_loop().call_later(PROBE_SECONDS, self.give_up)

    def give_up(self) -> None:
        """End a probe slot: a 503 when its head has not come, else close once answered."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._leave_slot()
        assert self.transport is not None
        if self.head is not None:
            self.head = None
            self._cap.refuse(self.transport)
        else:
            self.transport.close()  # sends the answer written so far, then closes

    def _leave_slot(self) -> None:
        if self in self._cap.probes:
            self._cap.probes.remove(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._leave_slot()
        if self._counted:
            self._cap.open -= 1
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.head is not None:
            self._probe_data(data)
        elif self._counted:
            assert self._inner is not None
            self._inner.data_received(data)
        elif self._inner is not None:  # a probe slot's second request: it is not served
            self.give_up()

    def _probe_data(self, data: bytes) -> None:
        assert self.head is not None and self.transport is not None
        self.head += data
        whole = _probe_head_state(self.head, len(data))
        if whole is None:
            return
        if not whole:
            self.give_up()
            return
        head, self.head = bytes(self.head), None
        assert self._timer is not None
        self._timer.cancel()  # served now, and closed PROBE_SECONDS later at the latest
        self._timer = asyncio.get_running_loop().call_later(PROBE_SECONDS, self.give_up)
        self._inner = self._cap.factory()
        self._inner.connection_made(self.transport)
        self._inner.data_received(head)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()
