"""OpenAI-style error bodies and the middleware that turns every failure into one.

Every error the server answers has the body
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` and a 4xx/5xx status.
A client mistake is always a 4xx that names what is wrong; a 500 means a server bug or a
failed forward pass, never bad input. Routes of an API with its own error shape (Anthropic's
Messages) register it under their path prefix in ``ERROR_BODIES``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from asyncengine.common.errors import (
    AdapterUnavailableError,
    EngineNotRunningError,
    EngineUnavailableError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    UnknownAdapterError,
)
from asyncengine.server.log_safe import log_safe
from asyncengine.server.request_ids import current_request_id

log = logging.getLogger("asyncengine.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

QUEUE_FULL_RETRY_AFTER_SECONDS = 1
# no replica is up: Ray Serve restarts one, which loads its model first
UNAVAILABLE_RETRY_AFTER_SECONDS = 10


class ApiError(Exception):
    """An error answered to the client as an OpenAI-style JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        # the request was not read to its end (e.g. its body timed out): do not reuse the socket
        self.close_connection = close_connection

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, body: dict[str, Any] | None = None) -> web.Response:
        """The error answered with ``body`` (default: OpenAI's shape, ``body()``)."""
        response = web.Response(
            status=self.status,
            body=msgspec.json.encode(self.body() if body is None else body),
            content_type="application/json",
            headers=self.headers,
        )
        if self.close_connection:
            response.force_close()
        return response


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_engine_error(exc: Exception) -> ApiError:
    """Map an exception raised by the engine's public API to the error the client sees."""
    if isinstance(exc, UnknownAdapterError | AdapterUnavailableError):  # as an unknown model
        return ApiError(404, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), param=exc.param, code=exc.code or "invalid_request")
    if isinstance(exc, QueueFullError):
        return ApiError(
            503,
            f"the server is at capacity: {exc}; retry later",
            type="server_overloaded",
            code="queue_full",
            headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_SECONDS)},
        )
    if isinstance(exc, EngineUnavailableError):
        return ApiError(
            503,
            f"{exc}; retry later",
            type="service_unavailable",
            code="engine_unavailable",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_SECONDS)},
        )
    if isinstance(exc, EngineNotRunningError):
        return ApiError(
            503, "the engine is not running", type="service_unavailable", code="engine_stopped"
        )
    if isinstance(exc, RequestFailedError):
        return ApiError(
            500,
            f"the engine failed this request (error id {logged_failure(exc)}; the server's log "
            "has the details)",
            type="server_error",
            code="request_failed",
        )
    raise TypeError(f"not an engine error: {exc!r}")


ErrorBody = Callable[[ApiError], dict[str, Any]]
# path prefix -> the error body of the API served under it (absent: OpenAI's)
ERROR_BODIES = web.AppKey("error_bodies", dict[str, ErrorBody])


def error_body_for(request: web.Request, error: ApiError) -> dict[str, Any]:
    """``error`` in the shape of the API that ``request`` addressed."""
    for prefix, body in request.app.get(ERROR_BODIES, {}).items():
        if request.path.startswith(prefix):
            return body(error)
    return error.body()


def logged_failure(exc: BaseException) -> str:
    """Log a failure's text server side under a fresh error id and return the id: the client
    gets the id, never the exception's text (paths, internals)."""
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    log.error(
        "%s (request %s): %s: %s",
        error_id,
        current_request_id(),
        type(exc).__name__,
        log_safe(str(exc), 2000),
    )
    return error_id


ENGINE_ERRORS = (
    InvalidRequestError,
    QueueFullError,
    EngineUnavailableError,
    EngineNotRunningError,
    RequestFailedError,
)

_HTTP_ERROR_TYPES: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
}

# nginx's status for a request whose client closed the connection before it was answered
CLIENT_CLOSED_REQUEST = 499

# longest reason written to the log for a refused request
LOGGED_REASON_CHARS = 300


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> ApiError:
    type_, code = _HTTP_ERROR_TYPES.get(exc.status, ("invalid_request_error", None))
    message = exc.text or exc.reason
    if exc.status == 404:
        message = f"no such endpoint: {request.method} {request.path}"
    elif exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        message = f"method {request.method} is not allowed on {request.path}; allowed: {allowed}"
    headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    return ApiError(exc.status, message, type=type_, code=code, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer ApiError, aiohttp's HTTP errors and any unexpected exception as JSON errors."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _refused(request, exc)
    except ENGINE_ERRORS as exc:
        return _refused(request, from_engine_error(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _refused(request, _from_http_exception(request, exc))
    except ConnectionResetError:
        if request.transport is not None and not request.transport.is_closing():
            return _internal_error(request)
        # the client closed its connection (mid-body: a cancelled request): nobody to answer
        log.info(
            "client left %s %s (request %s) before its answer",
            request.method,
            log_safe(request.path),
            current_request_id(),
        )
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    except Exception:
        return _internal_error(request)


def _internal_error(request: web.Request) -> web.Response:
    """A 500 with a fresh error id; the traceback goes to the log under that id."""
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    log.exception(
        "%s (request %s): unhandled error serving %s %s",
        error_id,
        current_request_id(),
        request.method,
        log_safe(request.path),
    )
    error = ApiError(
        500,
        f"internal server error (error id {error_id})",
        type="server_error",
        code="internal_error",
    )
    return error.response(error_body_for(request, error))


def _refused(request: web.Request, error: ApiError) -> web.Response:
    """The error's response, with one log line for a refusal: status, code and reason (messages
    name fields and numbers, never the prompt's text)."""
    if error.status < 500 or error.status == 503:
        log.info(
            "refused %s %s (request %s): %d %s: %s",
            request.method,
            log_safe(request.path),
            current_request_id(),
            error.status,
            error.code or error.type,
            log_safe(error.message, LOGGED_REASON_CHARS),
        )
    return error.response(error_body_for(request, error))
