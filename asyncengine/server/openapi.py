"""GET /openapi.json: an OpenAPI 3.1 document of every route the app serves, its request bodies
generated from the msgspec types the handlers decode them with (so the document cannot drift
from what the server accepts), and the error body every 4xx/5xx carries.

The route list is read from the app's router when the document is first asked for, so a new
route appears by itself; a POST route whose body type is listed in ``REQUEST_BODIES`` gets its
schema, the others take no body.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from aiohttp import web

from asyncengine.server.admin import EvictionChange, PinBody, PolicyChange, UnpinBody
from asyncengine.server.anthropic_schema import CountTokensRequest, MessagesRequest
from asyncengine.server.embeddings import EmbeddingRequest
from asyncengine.server.lora_routes import LoadLoraRequest, UnloadLoraRequest
from asyncengine.server.native import GenerateRequest
from asyncengine.server.openai_schema import ChatCompletionRequest, CompletionRequest
from asyncengine.server.responses_schema import ResponsesRequest
from asyncengine.server.tokenize_routes import DetokenizeRequest, TokenizeRequest

OPENAPI_PATH = "/openapi.json"
_DOCUMENT = web.AppKey("openapi_document", dict)  # filled at the first request

REQUEST_BODIES: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/generate": GenerateRequest,
    "/admin/policy": PolicyChange,
    "/admin/eviction-policy": EvictionChange,
    "/v1/cache/pin": PinBody,
    "/v1/cache/unpin": UnpinBody,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/load_lora_adapter": LoadLoraRequest,
    "/v1/unload_lora_adapter": UnloadLoraRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
STREAMING_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/generate", "/v1/messages", "/v1/responses"}
)


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """The body of every error the server answers (server/errors.py); under /v1/messages,
    Anthropic's shape: ``{"type": "error", "error": {"type", "message"}, "request_id"}``."""

    error: ErrorDetail


_REF = "#/components/schemas/{name}"
_PATH_PARAMETER = re.compile(r"\{([^}/]+)\}")
_ERROR_STATUSES = {
    "400": "the request is invalid (the message names the field)",
    "401": "missing or wrong API key",
    "404": "unknown model, route or stored response",
    "408": "the body or the generation timed out",
    "413": "the body is too large",
    "415": "the body is not JSON",
    "503": "the engine is overloaded, stopped or shutting down",
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _operation(method: str, path: str) -> dict[str, Any]:
    error = {"$ref": _REF.format(name="ErrorResponse")}
    ok: dict[str, Any] = {"description": "success", "content": _json({"type": "object"})}
    if path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    elif path in STREAMING_PATHS:
        ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    operation: dict[str, Any] = {
        "operationId": f"{method.lower()}_{path.strip('/').replace('/', '_') or 'root'}",
        "responses": {
            "200": ok,
            **{
                status: {"description": why, "content": _json(error)}
                for status, why in _ERROR_STATUSES.items()
            },
        },
    }
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _PATH_PARAMETER.findall(path)
    ]
    if parameters:
        operation["parameters"] = parameters
    body = REQUEST_BODIES.get(path)
    if method == "POST" and body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": _json({"$ref": _REF.format(name=body.__name__)}),
        }
    return operation


def openapi_document(app: web.Application, title: str = "asyncengine") -> dict[str, Any]:
    from asyncengine import __version__

    body_types = [*REQUEST_BODIES.values(), ErrorResponse]
    _, components = msgspec.json.schema_components(body_types, ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        method = route.method.upper()
        path = route.resource.canonical if route.resource is not None else None
        if path is None or method in {"HEAD", "OPTIONS", "*"}:
            continue
        paths.setdefault(path, {})[method.lower()] = _operation(method, path)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": __version__},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": components},
    }


async def openapi_handler(request: web.Request) -> web.Response:
    cache = request.app[_DOCUMENT]
    if not cache:
        cache.update(openapi_document(request.app))
    return web.Response(body=msgspec.json.encode(cache), content_type="application/json")


def add_openapi_route(app: web.Application) -> None:
    app[_DOCUMENT] = {}
    app.router.add_get(OPENAPI_PATH, openapi_handler)
