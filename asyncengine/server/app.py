"""The aiohttp application: routes, middlewares (metrics, errors, auth), health and metrics.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{model}],
POST /v1/messages[/count_tokens] (Anthropic's Messages: anthropic_messages.py), POST /v1/responses,
GET/DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items (OpenAI's Responses:
openai_responses.py), POST /generate, POST /tokenize and /detokenize (vLLM's: tokenize_routes.py),
GET /health, GET /metrics, GET /openapi.json (openapi.py), GET /version, the worker endpoints
SGLang's router polls (sglang_worker.py); with an admin token, GET/POST /admin/policy (admin.py:
its own bearer token, not the API key).

- An unknown ``model`` is answered 404 with code ``model_not_found`` (as OpenAI does).
- With an API key (or several), the routes need ``Authorization: Bearer <key>`` or, as
  Anthropic's clients send it, ``x-api-key: <key>`` (else 401), but for the admin routes (their
  token) and /health, /metrics, /openapi.json and /version, open for probes, scrapers and
  clients: /metrics without the series that tell one tenant of another's prompts unless the key
  is sent (server/tenancy.py).
- Bodies above ``max_body_bytes`` are answered 413, bodies not declared JSON 415, bodies that
  have not arrived within ``body_timeout`` seconds 408 (server/body.py).
- Requests that arrive over loopback with a Host or Origin that is not loopback (nor one of
  ``allowed_hosts``) are answered 403 (server/host_check.py); more than ``max_connections``
  requests at once 503 (probes a few later), and a client that reads nothing for
  ``write_timeout`` seconds is dropped (server/connection_limits.py).
- A stream that has sent nothing for ``stream_keep_alive`` seconds (a long prefill) gets a
  keep-alive its clients skip, so their read timeouts do not end it (server/keep_alive.py).
- Every response carries its request's id in ``x-request-id`` and ``request-id``, the id the
  server's log lines about it name (server/request_ids.py).
- The app does not start or stop the engine; its owner does (see serve.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from asyncengine.api.engine_client import EngineClient
from asyncengine.common.errors import EngineNotRunningError
from asyncengine.server.admin import (
    ADMIN_PATHS,
    ADMIN_PREFIX,
    add_admin_routes,
    carries_admin_token,
)
from asyncengine.server.anthropic_messages import add_anthropic_routes
from asyncengine.server.connection_limits import (
    DEFAULT_WRITE_TIMEOUT_SECONDS,
    LIMITS,
    ConnectionLimits,
    connection_limit_middleware,
    default_max_requests,
)
from asyncengine.server.embeddings import add_embeddings_route
from asyncengine.server.errors import (
    CLIENT_CLOSED_REQUEST,
    ApiError,
    Handler,
    error_middleware,
)
from asyncengine.server.host_check import ALLOWED_HOSTS, allowed_hosts, host_check_middleware
from asyncengine.server.keep_alive import DEFAULT_KEEP_ALIVE_SECONDS, check_keep_alive
from asyncengine.server.native import add_native_routes
from asyncengine.server.openai_responses import add_responses_routes
from asyncengine.server.openai_routes import add_openai_routes, json_response
from asyncengine.server.openapi import add_openapi_route
from asyncengine.server.prometheus import ServerMetrics
from asyncengine.server.request_ids import add_request_id_headers, request_id_middleware
from asyncengine.server.responses_store import (
    DEFAULT_STORE_BYTES,
    DEFAULT_STORE_TTL_SECONDS,
    ResponseStore,
)
from asyncengine.server.sglang_worker import (
    FLUSH_PATH,
    add_sglang_worker_routes,
    flush_needs_admin_token,
)
from asyncengine.server.state import OUTCOME, STATE, ServerState
from asyncengine.server.tenancy import (
    API_KEY_DIGEST,
    CACHE_ISOLATIONS,
    public_exposition,
    request_key_digest,
)
from asyncengine.server.tokenize_routes import add_tokenize_routes

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_SECONDS = 30.0

# POST path -> endpoint label of the request counter
GENERATION_ENDPOINTS = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/generate": "generate",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}

# served without the API key: health checks, scrapes, the API's description and the version
# (as vLLM serves /openapi.json and /version: they hold no data, and clients and fuzzers read
# them before any key; the version is the document's too)
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/version"})


def _outcome_of_status(status: int) -> str:
    if status < 400:
        return "success"
    if status == 408:
        return "timeout"
    if status == 503:
        return "overloaded"
    if status == CLIENT_CLOSED_REQUEST:
        return "abort"
    if status < 500:
        return "invalid"
    return "error"


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    endpoint = GENERATION_ENDPOINTS.get(request.path) if request.method == "POST" else None
    if endpoint is None:
        return await handler(request)
    metrics = request.app[STATE].metrics
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        # The client went away and aiohttp cancelled the handler.
        metrics.count_request(endpoint, "abort")
        raise
    except web.HTTPException as exc:  # only redirects escape the error middleware
        metrics.count_request(endpoint, _outcome_of_status(exc.status))
        raise
    metrics.count_request(endpoint, request.get(OUTCOME) or _outcome_of_status(response.status))
    return response


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    api_keys = request.app[STATE].api_keys
    if (
        not api_keys
        or request.path in OPEN_PATHS
        or request.path.startswith(ADMIN_PREFIX)  # the admin token guards these
        or request.path in ADMIN_PATHS
        or (request.path == FLUSH_PATH and flush_needs_admin_token(request.app))
        or request.method == "OPTIONS"
    ):
        return await handler(request)
    digest = request_key_digest(request, api_keys)
    if digest is None:
        raise ApiError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
            type="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    request[API_KEY_DIGEST] = digest
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.shutting_down:
        raise ApiError(
            503, "the server is shutting down", type="service_unavailable", code="shutting_down"
        )
    if not state.engine.is_running:
        raise ApiError(
            503, "the engine loop is not running", type="service_unavailable", code="engine_stopped"
        )
    return json_response({"status": "ok"})


async def version(request: web.Request) -> web.Response:
    from asyncengine import __version__

    return json_response({"version": __version__})


def whole_scrape_allowed(request: web.Request, state: ServerState) -> bool:
    """The whole scrape: to anyone without API keys, to a key holder, and under cache isolation
    by key (where a key holder must not learn of the others) to the admin token alone."""
    if state.cache_isolation == "api-key":
        return carries_admin_token(request)
    return not state.api_keys or request_key_digest(request, state.api_keys) is not None


async def metrics_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if whole_scrape_allowed(request, state):
        body = state.metrics.exposition()
    else:  # open to scrapers, less what tells of tenants and their prompts
        body = public_exposition(state.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _mark_shutting_down(app: web.Application) -> None:
    app[STATE].shutting_down = True


def _default_model_name(engine: EngineClient) -> str:
    try:
        return str(engine.model_name)
    except EngineNotRunningError:  # not started yet: the name it will serve
        return str(engine.config.model)


def _check_adapter_names(state: ServerState) -> None:
    """A LoRA adapter served under a base model's name would be unreachable (the name selects
    the base), as /v1/load_lora_adapter refuses it."""
    clash = sorted(set(state.served_model_names) & set(state.lora_names))
    if clash:
        raise ValueError(
            f"LoRA adapter {clash[0]!r} has a name the base model is served under "
            "(--served-model-name); requests could not reach it: rename the adapter"
        )


def create_app(
    engine: EngineClient,
    *,
    served_model_names: list[str] | None = None,
    api_key: str | Sequence[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    default_chat_max_tokens: int | None = None,
    metrics: ServerMetrics | None = None,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_SECONDS,
    admin_token: str | None = None,
    cache_isolation: str = "shared",
    report_cached_tokens: bool = True,
    responses_store_bytes: int = DEFAULT_STORE_BYTES,
    responses_store_ttl: float = DEFAULT_STORE_TTL_SECONDS,
    allowed_host_names: Sequence[str] = (),
    max_connections: int | None = None,
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_SECONDS,
    stream_keep_alive: float = DEFAULT_KEEP_ALIVE_SECONDS,
) -> web.Application:
    """Build the app around a started (or soon started) ``AsyncEngine``. ``api_key``: one key
    or several; ``cache_isolation`` and ``report_cached_tokens``: see server/tenancy.py.
    ``max_connections`` None: what the engine can queue and run, and a few more.

    ``responses_store_bytes`` / ``responses_store_ttl``: the bounds of the store that keeps
    /v1/responses answers for GET and ``previous_response_id`` (0 bytes: none are kept)."""
    if max_body_bytes < 1:
        raise ValueError("max_body_bytes must be >= 1")
    if body_timeout <= 0:
        raise ValueError("body_timeout must be > 0")
    check_keep_alive(stream_keep_alive)
    api_keys = tuple(k for k in ([api_key] if isinstance(api_key, str) else api_key or []) if k)
    if cache_isolation not in CACHE_ISOLATIONS:
        raise ValueError(f"cache_isolation must be one of {', '.join(CACHE_ISOLATIONS)}")
    if cache_isolation == "api-key" and not api_keys:
        raise ValueError("cache isolation by API key needs an API key (--api-key)")
    state = ServerState(
        engine=engine,
        metrics=metrics or ServerMetrics(engine),
        served_model_names=list(served_model_names or [_default_model_name(engine)]),
        api_keys=api_keys,
        cache_isolation=cache_isolation,
        report_cached_tokens=report_cached_tokens,
        default_chat_max_tokens=default_chat_max_tokens,
        body_timeout=body_timeout,
        stream_keep_alive=stream_keep_alive,
    )
    _check_adapter_names(state)
    app = web.Application(
        client_max_size=max_body_bytes,
        middlewares=[
            request_id_middleware,  # outermost: every answer, refusals too, carries the id
            host_check_middleware,
            metrics_middleware,  # outside the connection limit: its 503s count as overloaded
            connection_limit_middleware,
            error_middleware,
            auth_middleware,
        ],
    )
    app[STATE] = state
    app[ALLOWED_HOSTS] = allowed_hosts(allowed_host_names)
    config = engine.config
    app[LIMITS] = ConnectionLimits(
        default_max_requests(config.max_waiting_requests, config.max_running_requests)
        if max_connections is None
        else max_connections,
        write_timeout,
    )
    add_openai_routes(app)
    add_anthropic_routes(app)
    add_responses_routes(app, ResponseStore(responses_store_bytes, responses_store_ttl))
    add_embeddings_route(app)
    add_native_routes(app)
    add_sglang_worker_routes(app)
    add_tokenize_routes(app)
    if admin_token:
        add_admin_routes(app, admin_token)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/version", version)
    add_openapi_route(app)  # describes the routes above
    app.on_response_prepare.append(add_request_id_headers)
    app.on_shutdown.append(_mark_shutting_down)
    return app
