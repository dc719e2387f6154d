"""One id for each HTTP request, answered in ``x-request-id`` (OpenAI's header) and ``request-id``
(Anthropic's) on every response, streamed or not, errors included, and written in the server's
log lines about the request, so that a client can quote it and an operator find it.

A request's ``X-Request-Id`` header is its id when it is 1 to ``MAX_REQUEST_ID_CHARS`` of
``[A-Za-z0-9._:-]`` (a proxy's or a client's trace id, as vLLM honours it); any other value is
replaced by a fresh ``req_<hex>`` rather than echoed into headers and logs. The id is not the
engine's request id nor the response body's ``id``: a client cannot choose those, so two
requests sent with one trace id neither collide in the engine nor read each other's stored
responses.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

INCOMING_HEADER = "X-Request-Id"
RESPONSE_HEADERS = ("x-request-id", "request-id")
MAX_REQUEST_ID_CHARS = 128
_CLIENT_ID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_CHARS}}}")

REQUEST_ID: Any = (
    web.RequestKey("asyncengine_request_id", str)
    if hasattr(web, "RequestKey")
    else "asyncengine_request_id"
)
# the id of the request the running task serves, for log lines written far from its handler
_CURRENT: ContextVar[str | None] = ContextVar("asyncengine_request_id", default=None)


def request_id_for(given: str | None) -> str:
    """``given`` when it is a well-formed id, else a fresh one."""
    if given is not None and _CLIENT_ID.fullmatch(given):
        return given
    return f"req_{uuid.uuid4().hex}"


def current_request_id() -> str:
    """The id of the request being served ("-" outside one)."""
    return _CURRENT.get() or "-"


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request_id_for(request.headers.get(INCOMING_HEADER))
    request[REQUEST_ID] = request_id
    token = _CURRENT.set(request_id)
    try:
        return await handler(request)
    finally:
        _CURRENT.reset(token)


async def add_request_id_headers(request: web.Request, response: web.StreamResponse) -> None:
    """An ``on_response_prepare`` hook: it runs as the headers go out, for whole answers and
    streams alike."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        for name in RESPONSE_HEADERS:
            response.headers[name] = request_id
