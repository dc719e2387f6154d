"""Admin endpoints, served only when the server has an admin token (``--admin-token``):

- ``POST /admin/policy`` ``{"policy": "lpm+dynamic-chunking", "options": {...}}`` swaps the
  scheduling policy at the next step boundary (running requests and KV memory untouched);
  answers ``{"policy", "options", "previous"}``. A bad name or option is a 400 naming it, and
  so is a policy that is neither built in nor loaded at start-up (``allowed_policies``, and
  the policy the engine started with, named by spec or by its ``name``): a request never names
  a file or module to load.
- ``GET /admin/policy`` answers the policy in charge (FCFS once the policy failed: its
  ``policy_failures``), its shadow's agreement figures and the admission-block counts.
- ``POST /admin/eviction-policy`` ``{"policy": "lfu", "options": {...}}`` orders the prefix
  cache's evictions by another rule from now on (built-ins, or ``allowed_eviction_policies``);
  ``GET`` answers the rule and its figures by rule.
- ``POST /v1/cache/pin`` ``{"prompt": "..." | [token ids], "ttl_s": 600}`` (or ``messages``:
  a chat's opening turns, rendered as a chat request begins; ``cache_salt`` and, under cache
  isolation by key, ``api_key``: whose requests the pages serve; ``add_special_tokens``: as
  completions and chat requests take it, so that a text keys the ids a completion of it
  starts with, its BOS included) keeps the
  prompt's whole KV pages out of eviction (computing them first when not cached) and answers
  ``{"pin_id", "tokens", "pages", "expires_in_s"}``; past ``max_pinned_fraction`` of the pool it
  is a 409. ``POST /v1/cache/unpin`` ``{"pin_id": 1}`` releases it (404 for no such pin).

All need ``Authorization: Bearer <admin token>``: no or a malformed header is 401, a wrong
token 403; so does ``POST /flush_cache`` (it empties every tenant's cache) when the server has
an admin token or API keys (a 403 when there is no admin token; sglang_worker.py), and so do
the LoRA hot load and unload
(lora_routes.py). The API key (``--api-key``) does not open them, and those above are not there
at all (404) without an admin token. They share the server's own
address (127.0.0.1 unless told otherwise).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web
from msgspec import Struct

from asyncengine.cache.pins import PinLimitError
from asyncengine.common.config import ConfigError
from asyncengine.common.sampling_params import InvalidRequestError
from asyncengine.policies.eviction_registry import check_live_eviction_rule
from asyncengine.policies.registry import check_live_policy
from asyncengine.server.body import check_content_type
from asyncengine.server.chat_tools import render_prompt
from asyncengine.server.errors import ApiError, invalid_request
from asyncengine.server.off_loop import text_prompt_special_tokens
from asyncengine.server.openai_schema import decode_body
from asyncengine.server.state import STATE
from asyncengine.server.tenancy import matching_key_digest, namespaced_salt

ADMIN_PREFIX = "/admin/"
# LoRA hot load and unload (lora_routes.py): served with or without an admin token
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
# admin routes outside ADMIN_PREFIX (the admin token guards them, not the API key)
ADMIN_PATHS = frozenset({"/v1/cache/pin", "/v1/cache/unpin", *LORA_PATHS})
ADMIN_TOKEN = web.AppKey("asyncengine_admin_token", str)


class PolicyChange(Struct, kw_only=True, forbid_unknown_fields=True):
    policy: str
    options: dict[str, Any] | None = None


class EvictionChange(Struct, kw_only=True, forbid_unknown_fields=True):
    policy: str
    options: dict[str, Any] | None = None


class PinBody(Struct, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[int] | None = None  # text or token ids
    # or chat messages (a system prompt), as the chat template renders them before a turn
    messages: list[dict[str, Any]] | None = None
    ttl_s: float | None = None
    cache_salt: str | None = None  # the pages of the requests sent with this salt
    api_key: str | None = None  # under cache isolation by key: the pages of this key's requests
    # tokenized as the requests it serves: a text gets its tokenizer's special tokens (a BOS)
    # unless false, as a completion's prompt; rendered messages only when true, as a chat's
    add_special_tokens: bool | None = None


class UnpinBody(Struct, kw_only=True, forbid_unknown_fields=True):
    pin_id: int


def carries_admin_token(request: web.Request) -> bool:
    """The request's bearer token is the server's admin token (compared in constant time)."""
    token = request.app.get(ADMIN_TOKEN)
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if token is None or scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def check_admin_token(request: web.Request) -> None:
    """401/403 unless the request carries the admin token (403 when the server has none)."""
    token = request.app.get(ADMIN_TOKEN)
    if token is None:
        raise ApiError(
            403,
            "this needs the admin token, and the server has none (--admin-token)",
            type="permission_error",
            code="needs_admin_token",
        )
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise ApiError(
            401,
            "the admin endpoints need 'Authorization: Bearer <admin token>'",
            type="authentication_error",
            code="missing_admin_token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not carries_admin_token(request):
        raise ApiError(
            403, "wrong admin token", type="permission_error", code="invalid_admin_token"
        )


def _json(body: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def _swap(
    request: web.Request,
    body_type: type[PolicyChange] | type[EvictionChange],
    method: str,
    check: Callable[[str, Any], str],
    what: str,
    code: str,
    unsupported_code: str,
) -> web.Response:
    """A live swap (``engine.<method>``) of what ``body_type`` names, once ``check`` allows it
    against the start-up list (and gives the spec a listed name stands for); a refusal is a
    400 with ``code``, an engine without the method a 501 with ``unsupported_code``."""
    check_admin_token(request)
    check_content_type(request)
    change = decode_body(await request.read(), body_type)
    engine = request.app[STATE].engine
    if not hasattr(engine, method):
        raise ApiError(
            501,
            f"this server's engines (replicas) do not support a live {what} change",
            type="not_implemented",
            code=unsupported_code,
        )
    try:
        spec = check(change.policy, engine.config)
        previous = getattr(engine, method)(spec, change.options)
    except (ConfigError, ValueError, TypeError) as exc:
        raise invalid_request(str(exc), param="policy", code=code) from None
    return _json({"policy": spec, "options": change.options or {}, "previous": previous})


async def set_policy(request: web.Request) -> web.Response:
    return await _swap(
        request,
        PolicyChange,
        "set_policy",
        lambda name, config: check_live_policy(name, config.allowed_policies),
        "policy",
        "invalid_policy",
        "policy_swap_unsupported",
    )


async def get_policy(request: web.Request) -> web.Response:
    check_admin_token(request)
    engine = request.app[STATE].engine
    stats = engine.stats()
    in_charge = getattr(engine, "policy_in_charge", None)  # FCFS's once a policy failed
    policy, options = (
        in_charge() if in_charge else (engine.config.policy, engine.config.policy_options)
    )
    return _json(
        {
            "policy": policy,
            "options": options,
            "shadow": stats.get("shadow"),
            "admission_blocked": stats.get("admission_blocked"),
            "policy_swaps": stats.get("policy_swaps"),
            "policy_failures": stats.get("policy_failures"),
        }
    )


async def set_eviction_policy(request: web.Request) -> web.Response:
    return await _swap(
        request,
        EvictionChange,
        "set_eviction_policy",
        lambda name, config: check_live_eviction_rule(name, config.allowed_eviction_policies),
        "eviction policy",
        "invalid_eviction_policy",
        "eviction_swap_unsupported",
    )


async def get_eviction_policy(request: web.Request) -> web.Response:
    check_admin_token(request)
    stats = request.app[STATE].engine.stats()
    return _json(
        {
            "policy": stats.get("eviction_policy"),
            "rule": stats.get("eviction_rule"),
            "by_rule": stats.get("eviction_by_rule"),
            "pinned_prefixes": stats.get("pinned_prefixes"),
            "pages_pinned": stats.get("pages_pinned"),
        }
    )


def _pinning_engine(request: web.Request) -> Any:
    engine = request.app[STATE].engine
    if not hasattr(engine, "pin"):
        raise ApiError(
            501,
            "this server's engines (replicas) do not support pinned prefixes",
            type="not_implemented",
            code="pin_unsupported",
        )
    return engine


async def pin_prefix(request: web.Request) -> web.Response:
    check_admin_token(request)
    check_content_type(request)
    body = decode_body(await request.read(), PinBody)
    engine = _pinning_engine(request)
    salt = _pin_salt(request, body)
    try:
        prompt = _pin_prompt(engine, body)
        special = isinstance(prompt, str) and text_prompt_special_tokens(body.add_special_tokens)
        pin = await engine.pin(prompt, body.ttl_s, cache_salt=salt, add_special_tokens=special)
    except PinLimitError as exc:
        raise ApiError(409, str(exc), code="pin_limit") from None
    except InvalidRequestError as exc:
        raise invalid_request(str(exc), param=exc.param or "prompt", code="invalid_pin") from None
    expires_in = None if pin.expires_at is None else body.ttl_s
    return _json(
        {"pin_id": pin.pin_id, "tokens": pin.tokens, "pages": pin.pages, "expires_in_s": expires_in}
    )


def _pin_prompt(engine: Any, body: PinBody) -> str | list[int]:
    """The text or ids to pin: ``prompt``, or ``messages`` rendered as a chat request's start."""
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("give one of 'prompt' and 'messages'", param="prompt")
    if body.prompt is not None:
        return body.prompt
    assert body.messages is not None
    tokenizer = engine.tokenizer
    text = render_prompt(tokenizer, body.messages, None, {}, add_generation_prompt=False)
    return list(tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))


def _pin_salt(request: web.Request, body: PinBody) -> str | None:
    """The salt the pinned pages are keyed under: the requests' own ``cache_salt``, in the
    namespace of ``api_key`` under cache isolation by key (where every request has one)."""
    state = request.app[STATE]
    if state.cache_isolation != "api-key":
        if body.api_key is not None:
            raise invalid_request(
                "api_key names a key's cache namespace: only under --cache-isolation api-key",
                param="api_key",
            )
        return body.cache_salt
    if body.api_key is None:
        raise invalid_request(
            "under cache isolation by key a pin names the API key whose requests it serves",
            param="api_key",
        )
    digest = matching_key_digest(f"Bearer {body.api_key}", state.api_keys)
    if digest is None:
        raise invalid_request("api_key is not one of this server's keys", param="api_key")
    return namespaced_salt(digest, body.cache_salt)


async def unpin_prefix(request: web.Request) -> web.Response:
    check_admin_token(request)
    check_content_type(request)
    body = decode_body(await request.read(), UnpinBody)
    engine = _pinning_engine(request)
    try:
        pin = engine.unpin(body.pin_id)
    except KeyError:
        raise ApiError(
            404, f"no pin {body.pin_id} (unpinned, or past its ttl)", code="no_such_pin"
        ) from None
    return _json({"pin_id": pin.pin_id, "tokens": pin.tokens, "unpinned": True})


def add_admin_routes(app: web.Application, token: str) -> None:
    if not token:
        raise ValueError("the admin token must not be empty")
    app[ADMIN_TOKEN] = token
    app.router.add_post("/admin/policy", set_policy)
    app.router.add_get("/admin/policy", get_policy)
    app.router.add_post("/admin/eviction-policy", set_eviction_policy)
    app.router.add_get("/admin/eviction-policy", get_eviction_policy)
    app.router.add_post("/v1/cache/pin", pin_prefix)
    app.router.add_post("/v1/cache/unpin", unpin_prefix)
