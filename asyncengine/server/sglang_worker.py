"""The worker endpoints SGLang's router (the ``sglang-router`` package) asks of a server, so
that it can route over several asyncengine servers as over SGLang workers.

GET /server_info and /get_server_info (limits and engine stats; under cache isolation by API key
only the figures /metrics shows without a key, tenancy.py), GET /model_info and
/get_model_info (the model), GET /get_load (requests and tokens in the engine), POST
/flush_cache (empty the prefix cache; 400 while requests run or wait; a GET is 405: a state
change is never a GET, which a web page can make a browser send; it needs the admin token when
the server has one or API keys), GET /health_generate
(/health that also generates one token; a failure's text goes to the log, the client gets an
error id). /health, /generate and /v1/* are the app's own.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from aiohttp import web

from asyncengine.common.errors import EngineError
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.server.admin import ADMIN_TOKEN, check_admin_token
from asyncengine.server.completion import generate
from asyncengine.server.errors import ApiError, logged_failure
from asyncengine.server.openai_routes import json_response
from asyncengine.server.prometheus import ENGINE_COUNTERS, ENGINE_GAUGES
from asyncengine.server.state import STATE, ServerState
from asyncengine.server.tenancy import cache_revealing

# the engine figures the open /metrics scrape shows: all a key holder may see under cache
# isolation by key (the others tell of the other keys' cached prompts)
_PUBLIC_STATS = frozenset(
    key
    for name, (key, _) in {**ENGINE_COUNTERS, **ENGINE_GAUGES}.items()
    if not cache_revealing(name)
)


def _numbers(stats: dict[str, Any], state: ServerState) -> dict[str, float]:
    whole = state.cache_isolation != "api-key"
    return {
        k: v
        for k, v in stats.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (whole or k in _PUBLIC_STATS)
    }


def rank_stats(engine: Any) -> list[dict[str, Any]]:
    """The engine stats of each data-parallel rank: one per replica that reported under
    ``--replicas`` (each a whole engine), else the one engine's."""
    per_replica = getattr(engine, "replica_stats", None)
    if per_replica is None:
        return [engine.stats()]
    return [stats for _, stats in sorted(per_replica().items())]


async def server_info(request: web.Request) -> web.Response:
    """SGLang's figures, with SGLang's meaning under data parallelism: the pool and the running
    cap are one rank's (a replica's: they share their config), ``dp_size`` counts the ranks and
    ``internal_states`` holds one entry per rank."""
    state = request.app[STATE]
    engine = state.engine
    config = engine.config
    ranks = rank_stats(engine)
    pages = int(ranks[0].get("pages_total", 0)) if ranks else 0
    return json_response(
        {
            "model_path": config.model,
            "tokenizer_path": config.model,
            "served_model_name": state.model_name,
            "context_length": engine.max_model_len,
            "page_size": config.page_size,
            "max_total_num_tokens": pages * config.page_size,
            "max_running_requests": config.max_running_requests,
            "schedule_policy": config.policy,
            "chunked_prefill_size": config.chunked_prefill_size,
            "dp_size": max(1, len(ranks)),  # one before the first replica reported
            "tp_size": 1,
            "version": f"asyncengine {_version()}",
            "internal_states": [_numbers(stats, state) for stats in ranks or [{}]],
        }
    )


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    return json_response(
        {
            "model_path": engine.config.model,
            "tokenizer_path": engine.config.model,
            "served_model_name": state.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "max_context_length": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "supports_vision": False,
        }
    )


def live_pages(stats: dict[str, Any]) -> int:
    """The pages live requests hold, their cached prefixes included: a request's load whether
    its prompt was cached or computed, so that it tells no one what another client cached
    (``pages_used`` leaves the cached prefix out; pinned pages count as held)."""
    held = ("pages_total", "pages_free", "pages_tail", "pages_evictable")
    total, free, tail, evictable = (int(stats.get(key, 0)) for key in held)
    return total - free - tail - evictable


def _load(rank: int, stats: dict[str, Any], page_size: int) -> dict[str, int]:
    waiting = int(stats.get("waiting", 0))
    running = int(stats.get("running", 0)) + int(stats.get("prefilling", 0))
    return {
        "dp_rank": rank,
        "num_reqs": running + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": live_pages(stats) * page_size,
    }


async def get_load(request: web.Request) -> web.Response:
    """One entry per data-parallel rank, as SGLang answers: under ``--replicas`` one per
    replica, in the order (and with the ranks) of /server_info's ``internal_states``."""
    engine = request.app[STATE].engine
    ranks = rank_stats(engine) or [{}]  # one idle rank before the first replica reported
    loads = [_load(rank, stats, engine.config.page_size) for rank, stats in enumerate(ranks)]
    return web.Response(body=msgspec.json.encode(loads), content_type="application/json")


FLUSH_PATH = "/flush_cache"


def flush_needs_admin_token(app: web.Application) -> bool:
    """Emptying the prefix cache slows every tenant: an operator's act, the admin token's when
    the server has one or API keys (a 403 without an admin token: one key must not empty the
    others' caches; the pages a key's prompts hold are shared with other keys, or under
    isolation by key spread over its salts' namespaces, so none can be dropped for one key
    alone). A server with neither trusts whoever reaches it, as SGLang does."""
    return app.get(ADMIN_TOKEN) is not None or bool(app[STATE].api_keys)


async def flush_cache(request: web.Request) -> web.Response:
    """Empty the prefix cache (``flush_needs_admin_token`` says who may)."""
    state = request.app[STATE]
    if flush_needs_admin_token(request.app):
        check_admin_token(request)
    engine = state.engine
    try:
        await engine.reset_prefix_cache()
    except EngineError as exc:
        raise ApiError(
            400,
            f"the prefix cache was not flushed: {exc}; flush it while no request runs or waits",
            code="engine_busy",
        ) from None
    return json_response({"message": "the prefix cache was flushed"})


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        (output,) = await generate(engine, [0], params, f"health-{uuid.uuid4().hex}")
    except Exception as exc:
        raise ApiError(
            503,
            f"the engine could not generate (error id {logged_failure(exc)})",
            type="service_unavailable",
            code="engine_unhealthy",
        ) from None
    if output.usage.completion_tokens != 1:
        raise ApiError(
            503,
            "the engine generated no token",
            type="service_unavailable",
            code="engine_unhealthy",
        )
    return json_response({"status": "ok"})


def _version() -> str:
    from asyncengine import __version__

    return __version__


def add_sglang_worker_routes(app: web.Application) -> None:
    for path, handler in (
        ("/server_info", server_info),
        ("/get_server_info", server_info),
        ("/model_info", model_info),
        ("/get_model_info", model_info),
        ("/get_load", get_load),
        ("/health_generate", health_generate),
    ):
        app.router.add_get(path, handler)
    app.router.add_post(FLUSH_PATH, flush_cache)
