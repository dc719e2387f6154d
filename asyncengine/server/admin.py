"""Admin endpoints, served only when the server has an admin token (``--admin-token``):

- ``POST /admin/policy`` ``{"policy": "lpm+dynamic-chunking", "options": {...}}`` swaps the
  scheduling policy at the next step boundary (running requests and KV memory untouched);
  answers ``{"policy", "options", "previous"}``. A bad name or option is a 400 naming it, and
  so is a policy that is neither built in nor listed at start-up (``allowed_policies``): a
  request never names a file or module to load.
- ``GET /admin/policy`` answers the live policy, its shadow's agreement figures and the
  admission-block counts.

Both need ``Authorization: Bearer <admin token>``: no or a malformed header is 401, a wrong
token 403. The API key (``--api-key``) does not open them, and they are not there at all (404)
without an admin token. They share the server's own address (127.0.0.1 unless told otherwise).
"""

from __future__ import annotations

import hmac
from typing import Any

import msgspec
from aiohttp import web
from msgspec import Struct

from asyncengine.common.config import ConfigError
from asyncengine.policies.registry import check_live_policy
from asyncengine.server.body import check_content_type
from asyncengine.server.errors import ApiError, invalid_request
from asyncengine.server.openai_schema import decode_body
from asyncengine.server.state import STATE

ADMIN_PREFIX = "/admin/"
ADMIN_TOKEN = web.AppKey("asyncengine_admin_token", str)


class PolicyChange(Struct, kw_only=True, forbid_unknown_fields=True):
    policy: str
    options: dict[str, Any] | None = None


def _check_token(request: web.Request) -> None:
    token = request.app[ADMIN_TOKEN]
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise ApiError(
            401,
            "the admin endpoints need 'Authorization: Bearer <admin token>'",
            type="authentication_error",
            code="missing_admin_token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(
            403, "wrong admin token", type="permission_error", code="invalid_admin_token"
        )


def _json(body: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def set_policy(request: web.Request) -> web.Response:
    _check_token(request)
    check_content_type(request)
    change = decode_body(await request.read(), PolicyChange)
    engine = request.app[STATE].engine
    if not hasattr(engine, "set_policy"):
        raise ApiError(
            501,
            "this server's engines (replicas) do not support a live policy change",
            type="not_implemented",
            code="policy_swap_unsupported",
        )
    try:
        check_live_policy(change.policy, engine.config.allowed_policies)
        previous = engine.set_policy(change.policy, change.options)
    except (ConfigError, ValueError, TypeError) as exc:
        raise invalid_request(str(exc), param="policy", code="invalid_policy") from None
    return _json({"policy": change.policy, "options": change.options or {}, "previous": previous})


async def get_policy(request: web.Request) -> web.Response:
    _check_token(request)
    engine = request.app[STATE].engine
    stats = engine.stats()
    return _json(
        {
            "policy": engine.config.policy,
            "options": engine.config.policy_options,
            "shadow": stats.get("shadow"),
            "admission_blocked": stats.get("admission_blocked"),
            "policy_swaps": stats.get("policy_swaps"),
        }
    )


def add_admin_routes(app: web.Application, token: str) -> None:
    if not token:
        raise ValueError("the admin token must not be empty")
    app[ADMIN_TOKEN] = token
    app.router.add_post("/admin/policy", set_policy)
    app.router.add_get("/admin/policy", get_policy)
