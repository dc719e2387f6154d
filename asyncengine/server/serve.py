"""Run the HTTP server: engine start, uvloop, SIGINT/SIGTERM, graceful shutdown.

Shutdown: on SIGINT/SIGTERM the listening socket closes and /health turns 503; in-flight
requests get ``shutdown_grace`` seconds to finish, then their handlers are cancelled (which
aborts their engine requests and frees their KV); then the engine stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import web

from asyncengine.api.engine_client import EngineClient
from asyncengine.api.event_loop import run
from asyncengine.common.config import EngineConfig
from asyncengine.server.app import (
    DEFAULT_BODY_TIMEOUT_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    create_app,
)
from asyncengine.server.client_error_log import log_client_errors_quietly
from asyncengine.server.connection_limits import (
    DEFAULT_IDLE_TIMEOUT_SECONDS,
    DEFAULT_WRITE_TIMEOUT_SECONDS,
    MAX_DEFAULT_OPEN_CONNECTIONS,
    OpenConnections,
    default_max_open_connections,
    raise_open_files_limit,
)
from asyncengine.server.keep_alive import DEFAULT_KEEP_ALIVE_SECONDS, check_keep_alive
from asyncengine.server.port import PortInUseError, check_port_free
from asyncengine.server.prometheus import ServerMetrics
from asyncengine.server.responses_store import DEFAULT_STORE_BYTES, DEFAULT_STORE_TTL_SECONDS
from asyncengine.server.state import STATE
from asyncengine.server.tenancy import CACHE_ISOLATIONS

log = logging.getLogger("asyncengine.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_GRACE_SECONDS = 30.0
API_KEY_ENV = "ASYNCENGINE_API_KEY"
ADMIN_TOKEN_ENV = "ASYNCENGINE_ADMIN_TOKEN"
# After the grace period the engine aborts what is left; handlers then send their final
# ("abort") chunk and [DONE], which takes well under this many seconds.
ABORT_FLUSH_SECONDS = 5.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's command-line options (engine options are the CLI's)."""
    group = parser.add_argument_group("HTTP server")
    group.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})"
    )
    group.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free)"
    )
    group.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="model name(s) clients may ask for (repeatable; default: the engine's model name)",
    )
    group.add_argument(
        "--server-log-interval",
        dest="server_log_interval",
        type=float,
        default=None,
        help="seconds between summary lines while serving (default: --log-interval, 10); "
        "0 turns them off. A line is written only when something changed",
    )
    group.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of chat requests that give none (default: up to the context length)",
    )
    group.add_argument(
        "--responses-store-mib",
        type=float,
        default=DEFAULT_STORE_BYTES / 2**20,
        help="memory (MiB of JSON) that keeps /v1/responses answers for GET and "
        "previous_response_id, the oldest dropped first; 0 keeps none "
        f"(default {DEFAULT_STORE_BYTES / 2**20:g})",
    )
    group.add_argument(
        "--responses-store-ttl",
        type=float,
        default=DEFAULT_STORE_TTL_SECONDS,
        help="seconds a stored /v1/responses answer is kept "
        f"(default {DEFAULT_STORE_TTL_SECONDS:g})",
    )
    group.add_argument(
        "--record-trace",
        metavar="FILE",
        default=None,
        help="write every arrival, finish and step as a JSONL live trace, to replay under other "
        "policies with scripts/compare_policies.py --trace FILE",
    )
    group.add_argument(
        "--record-trace-hashed",
        action="store_true",
        help="record page hashes instead of prompt token ids (the replay keeps the page sharing)",
    )
    _add_access_arguments(group)
    _add_connection_arguments(group)


def _add_access_arguments(group: argparse._ArgumentGroup) -> None:
    """Who may use the server and what one client may learn of another's (docs/SECURITY.md)."""
    group.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer <key>' on /v1/* and /generate (repeatable: any of "
        f"the keys; default: ${API_KEY_ENV})",
    )
    group.add_argument(
        "--cache-isolation",
        choices=CACHE_ISOLATIONS,
        default="shared",
        help="api-key: each API key gets its own prefix-cache namespace (clients of different "
        "keys share no cached pages); shared (default): one cache, split only by cache_salt",
    )
    group.add_argument(
        "--omit-cached-tokens",
        action="store_true",
        help="leave cached_tokens out of responses (it tells a client what others sent)",
    )
    group.add_argument(
        "--admin-token",
        default=os.environ.get(ADMIN_TOKEN_ENV),
        help="serve the admin endpoints, guarded by 'Authorization: Bearer <token>': "
        "/admin/policy and /admin/eviction-policy (live swaps), /v1/cache/pin and "
        "/v1/cache/unpin, /v1/load_lora_adapter and /v1/unload_lora_adapter; it alone may "
        "empty the prefix cache (/flush_cache) when the server has it or API keys "
        f"(default: ${ADMIN_TOKEN_ENV}; none: no admin endpoints)",
    )
    group.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name (besides localhost, loopback addresses and this machine's name) "
        "that a loopback server accepts in Host or Origin, e.g. a proxy's; repeatable "
        "(others get 403)",
    )


def _add_connection_arguments(group: argparse._ArgumentGroup) -> None:
    """Bounds on connections: body size and time, open connections and requests, stalled
    readers, shutdown."""
    group.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted, else 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_SECONDS,
        help="seconds a client gets to send a request's whole body, else 408 "
        f"(default {DEFAULT_BODY_TIMEOUT_SECONDS:g})",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="requests served at once, streams included; more get 503 (default: "
        "max_waiting_requests + max_running_requests + 64)",
    )
    group.add_argument(
        "--max-open-connections",
        type=int,
        default=None,
        help="TCP connections open at once, idle ones included; more are answered 503 and "
        "closed, a few GET /health probes excepted (default: the open-files limit less 256, at most "
        f"{MAX_DEFAULT_OPEN_CONNECTIONS})",
    )
    group.add_argument(
        "--write-timeout",
        type=float,
        default=DEFAULT_WRITE_TIMEOUT_SECONDS,
        help="seconds a response may wait for its client to read it, then the connection is "
        f"dropped and its request aborted (default {DEFAULT_WRITE_TIMEOUT_SECONDS:g})",
    )
    group.add_argument(
        "--stream-keep-alive",
        type=float,
        default=DEFAULT_KEEP_ALIVE_SECONDS,
        help="seconds a stream may send nothing (a long prefill) before the server writes a "
        "keep-alive its clients skip (an SSE comment; Anthropic's route: a ping event), so "
        f"client and proxy read timeouts do not end it; 0: off (default {DEFAULT_KEEP_ALIVE_SECONDS:g})",
    )
    group.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_SECONDS,
        help="seconds an idle keep-alive connection stays open "
        f"(default {DEFAULT_IDLE_TIMEOUT_SECONDS:g})",
    )
    group.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE_SECONDS,
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default 30)",
    )


class _CappedSite(web.TCPSite):
    """aiohttp's TCP site with ``connections`` (around the runner's server) as the protocol
    factory: the listener, its port and its closing on ``runner.cleanup()`` stay aiohttp's."""

    __slots__ = ("_connections",)

    def __init__(
        self, runner: web.AppRunner, host: str, port: int, connections: OpenConnections
    ) -> None:
        super().__init__(runner, host, port, reuse_address=True)
        self._connections = connections

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; TCPSite.start would listen too
        self._server = await asyncio.get_running_loop().create_server(
            self._connections,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
        )


async def start_http(
    app: web.Application,
    host: str = DEFAULT_HOST,
    port: int = 0,
    shutdown_grace: float = 5.0,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_SECONDS,
    max_open_connections: int | None = None,
) -> tuple[web.AppRunner, int]:
    """Listen on ``host:port`` (0: an ephemeral port); return the runner and the bound port.

    ``max_open_connections`` (None: ``default_max_open_connections()``): connections past it
    are answered 503 and closed, a few GET /health probes excepted (server/connection_limits.py).

    ``shutdown_grace`` is ``drain``'s: aiohttp's own shutdown timeout (after which it cancels
    the handlers still running) comes ``ABORT_FLUSH_SECONDS`` later, so that the two never fire
    together: at the grace deadline the engine aborts what is left and every handler ends its
    response itself (final chunk, [DONE]); aiohttp cancels only a handler still stuck after that.
    """
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # engine request at once instead of when the next token fails to write.
    # auto_decompress off: a compressed body is refused (server/body.py), and a body refused
    # unread is skipped without inflating it (a few MB of gzip inflate to GB).
    log_client_errors_quietly()
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=shutdown_grace + ABORT_FLUSH_SECONDS,
        access_log=None,
        keepalive_timeout=idle_timeout,
        auto_decompress=False,
    )
    await runner.setup()
    try:
        site = _CappedSite(runner, host, port, _open_connections(runner, max_open_connections))
        await site.start()
    except (OSError, ValueError) as exc:
        await runner.cleanup()
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            raise PortInUseError(port) from None  # taken since check_port_free looked
        raise
    return runner, int(runner.addresses[0][1])


def _open_connections(runner: web.AppRunner, limit: int | None) -> OpenConnections:
    """The cap on the runner's open connections; refusals count in the app's metrics."""
    assert runner.server is not None, "the runner is set up"
    state = runner.app.get(STATE)
    if limit is None:
        limit = default_max_open_connections()
        log.info("open connections capped at %d (--max-open-connections)", limit)
    return OpenConnections(
        runner.server,
        limit,
        state.metrics.connections_refused.inc if state is not None else lambda: None,
    )


async def drain(runner: web.AppRunner, engine: EngineClient, grace: float) -> None:
    """Close the listener, give in-flight requests ``grace`` seconds, then abort the rest."""
    cleanup = asyncio.create_task(runner.cleanup())
    done, _ = await asyncio.wait({cleanup}, timeout=grace)
    if not done:
        stats = engine.stats() if engine.is_running else {}
        in_flight = sum(stats.get(k, 0) for k in ("running", "prefilling", "waiting"))
        log.info("grace period over: aborting %s in-flight request(s)", in_flight)
        await engine.stop()  # aborts every request: each stream ends with finish_reason "abort"
    await cleanup


async def run_server(
    config: EngineConfig,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | list[str] | None = None,
    log_interval: float | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    *,
    served_model_names: list[str] | None = None,
    default_chat_max_tokens: int | None = None,
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE_SECONDS,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_SECONDS,
    stop_event: asyncio.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
    install_signal_handlers: bool = True,
    engine: Any = None,
    metrics: ServerMetrics | None = None,
    admin_token: str | None = None,
    cache_isolation: str = "shared",
    report_cached_tokens: bool = True,
    record_trace: str | None = None,
    record_trace_hashed: bool = False,
    responses_store_bytes: int = DEFAULT_STORE_BYTES,
    responses_store_ttl: float = DEFAULT_STORE_TTL_SECONDS,
    allowed_hosts: list[str] | None = None,
    max_connections: int | None = None,
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_SECONDS,
    stream_keep_alive: float = DEFAULT_KEEP_ALIVE_SECONDS,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_SECONDS,
    max_open_connections: int | None = None,
) -> int:
    """Start the engine and serve until SIGINT/SIGTERM (or ``stop_event``); return 0.

    ``on_ready(port)`` is called once the socket listens (port 0 picks a free one). ``engine``
    replaces the AsyncEngine built from ``config`` (replicas on Ray pass theirs, with their
    ``metrics``). ``log_interval``, when given, replaces the config's: seconds between summary
    lines.
    """
    from asyncengine.api.engine import AsyncEngine

    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    if install_signal_handlers:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
    if log_interval is not None:
        config = config.replace(log_interval=log_interval)
    check_port_free(host, port)  # before the model loads
    check_keep_alive(stream_keep_alive)
    if engine is None:
        engine = AsyncEngine(config)
    if record_trace and not hasattr(engine, "record_trace"):
        raise ValueError("--record-trace records one engine; it is not available with replicas")
    await engine.start()
    if record_trace:
        engine.record_trace(record_trace, hashed=record_trace_hashed)
        log.info("recording a live trace to %s", record_trace)
    runner: web.AppRunner | None = None
    try:
        app = create_app(
            engine,
            served_model_names=served_model_names,
            api_key=api_key,
            max_body_bytes=max_body_bytes,
            default_chat_max_tokens=default_chat_max_tokens,
            body_timeout=body_timeout,
            metrics=metrics,
            admin_token=admin_token,
            cache_isolation=cache_isolation,
            report_cached_tokens=report_cached_tokens,
            responses_store_bytes=responses_store_bytes,
            responses_store_ttl=responses_store_ttl,
            allowed_host_names=allowed_hosts or (),
            max_connections=max_connections,
            write_timeout=write_timeout,
            stream_keep_alive=stream_keep_alive,
        )
        runner, bound_port = await start_http(
            app, host, port, shutdown_grace, idle_timeout, max_open_connections
        )
        log.info(
            "serving %s on http://%s:%d (api key %s, admin endpoints %s)",
            engine.model_name,
            host,
            bound_port,
            "required" if api_key else "off",
            "on" if admin_token else "off",
        )
        summary = getattr(engine, "summary", None)  # replicas log their own summaries
        if summary is not None:
            summary.add_counter("http_requests", app[STATE].metrics.requests_served)
        if on_ready is not None:
            on_ready(bound_port)
        await stop.wait()
        log.info("shutting down: no new connections; in-flight requests get %gs", shutdown_grace)
        app[STATE].shutting_down = True
    finally:
        # the summary line goes on while in-flight requests drain: the operator sees them finish
        if runner is not None:
            await drain(runner, engine, shutdown_grace)
        await engine.stop()
        for sig in installed:
            loop.remove_signal_handler(sig)
    log.info("server stopped")
    return 0


def http_options(args: argparse.Namespace) -> dict[str, Any]:
    """``run_server``'s keyword arguments from the options of ``add_serve_arguments``."""
    return {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key or os.environ.get(API_KEY_ENV),
        "cache_isolation": args.cache_isolation,
        "report_cached_tokens": not args.omit_cached_tokens,
        "log_interval": args.server_log_interval,
        "max_body_bytes": args.max_body_bytes,
        "served_model_names": args.served_model_name,
        "default_chat_max_tokens": args.default_max_tokens,
        "shutdown_grace": args.shutdown_grace,
        "body_timeout": args.body_timeout,
        "admin_token": args.admin_token,
        "record_trace": args.record_trace,
        "record_trace_hashed": args.record_trace_hashed,
        "responses_store_bytes": int(args.responses_store_mib * 2**20),
        "responses_store_ttl": args.responses_store_ttl,
        "allowed_hosts": args.allowed_host,
        "max_connections": args.max_connections,
        "max_open_connections": args.max_open_connections,
        "write_timeout": args.write_timeout,
        "stream_keep_alive": args.stream_keep_alive,
        "idle_timeout": args.idle_timeout,
    }


def serve(config: EngineConfig, args: argparse.Namespace) -> int:
    """Run ``run_server`` with the options of ``add_serve_arguments`` on uvloop when available,
    the open-files limit raised first (the default ``--max-open-connections`` follows it)."""
    raise_open_files_limit()
    return run(run_server(config, **http_options(args)))
