"""Reading a request's JSON body: its content type, a deadline for the whole body, then
decoding with exact errors (``decode_body``).

- A Content-Type other than JSON (``application/json`` or ``*/*+json``, UTF-8), or none, is
  answered 415: a web page can send a body without a JSON type to another origin without
  the browser asking first (a "simple" request), never one with it.
- A body sent with a ``Content-Encoding`` (gzip, deflate, ...) is answered 415 and its
  connection closed, unread: a few MB of gzip inflate to GB, so the server (which starts
  aiohttp with ``auto_decompress=False``) spends on a body only what the client sends.
- A body that has not fully arrived after ``ServerState.body_timeout`` seconds (a chunked body
  that never ends, a client that stalls) is answered 408 and its connection closed.
- Bodies above the app's ``client_max_size`` are answered 413 by aiohttp's reader.
- Top-level fields the request type does not read are accepted, and named in one warning
  line per request (server/unknown_fields.py).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from asyncengine.server.errors import ApiError
from asyncengine.server.openai_schema import RequestT, decode_body
from asyncengine.server.state import ServerState
from asyncengine.server.tenancy import isolate
from asyncengine.server.unknown_fields import warn_unknown_fields

JSON_TYPE = "application/json"


def check_content_type(request: web.Request) -> None:
    """415 unless the body is declared JSON (UTF-8), sent as it is (no Content-Encoding)."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower() or "identity"
    if encoding != "identity":
        raise ApiError(
            415,
            f"compressed request bodies are not accepted (Content-Encoding: {encoding!r}); "
            "send the JSON uncompressed",
            code="unsupported_media_type",
            close_connection=True,
        )
    mime = request.content_type if "Content-Type" in request.headers else ""
    charset = (request.charset or "utf-8").lower()
    if (mime == JSON_TYPE or mime.endswith("+json")) and charset in ("utf-8", "utf8"):
        return
    raise ApiError(
        415,
        f"the request body must be JSON sent as Content-Type: {JSON_TYPE} (UTF-8), not "
        f"{request.headers.get('Content-Type', 'none')!r}; with curl pass "
        f"-H 'Content-Type: {JSON_TYPE}'",
        code="unsupported_media_type",
    )


async def read_json(
    request: web.Request, state: ServerState, request_type: type[RequestT]
) -> RequestT:
    """The body decoded into ``request_type``, or the ApiError that says what is wrong."""
    check_content_type(request)
    try:
        body = await asyncio.wait_for(request.read(), state.body_timeout)
    except asyncio.TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {state.body_timeout:g} s",
            code="request_timeout",
            close_connection=True,
        ) from None
    decoded = decode_body(body, request_type)
    warn_unknown_fields(request.path, body, request_type)
    return isolate(request, state.cache_isolation, decoded)
