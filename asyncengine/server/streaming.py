"""The streaming tail every endpoint shares: one engine request as an SSE response.

An endpoint supplies only how deltas become frames (a ``StreamFormat``); this module owns the
rest: headers go out once the engine accepted the request (its grammar compiled: a refusal is
still a proper 4xx; a queued or long prefill does not hold them back), engine errors after the
headers are reported in-band, a client that goes away ends the request, and however the handler
ends (done, error, client gone, cancelled) the ``RequestStream`` is closed, which aborts the
request in the engine unless it finished.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from asyncengine.api.engine_client import DeltaStream
from asyncengine.common.outputs import StreamDelta
from asyncengine.server.completion import outcome_of
from asyncengine.server.errors import ENGINE_ERRORS, ApiError, from_engine_error
from asyncengine.server.keep_alive import COMMENT_FRAME, keeping_alive
from asyncengine.server.sse import ClientGone, SSEWriter
from asyncengine.server.state import OUTCOME, ServerState

Frame = Any  # a JSON-encodable payload of one ``data:`` event


class StreamFormat(Protocol):
    """How one endpoint turns a request's deltas into SSE frames."""

    def opening(self) -> list[Frame]:
        """Frames sent right after the headers, before the first delta's."""
        ...

    def admitted(self, cached_tokens: int | None) -> list[Frame]:
        """Frames once the request was first scheduled (``DeltaStream.admitted``: its prompt
        tokens read from the prefix cache, None when not told), before the first delta's."""
        ...

    def frames(self, delta: StreamDelta) -> list[Frame]:
        """Frames for one delta (none when it carries nothing worth sending)."""
        ...

    def closing(self, finals: list[StreamDelta]) -> list[Frame]:
        """Frames after every choice's final delta (``finals``, by choice index), before
        ``[DONE]``."""
        ...


async def _next(stream: DeltaStream) -> StreamDelta | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def stream_response(
    request: web.Request,
    state: ServerState,
    stream: DeltaStream,
    fmt: StreamFormat,
    choices: int,
    *,
    done_marker: bool = True,
    error_frame: Callable[[ApiError], Frame] = ApiError.body,
    keep_alive: bytes = COMMENT_FRAME,
) -> web.StreamResponse:
    """Send ``stream`` (all its ``choices``) as server-sent events formatted by ``fmt``; record
    the outcome. ``done_marker``: end with ``data: [DONE]`` (OpenAI's APIs; Anthropic's ends
    without); ``error_frame``: the frame that reports an engine failure after the headers;
    ``keep_alive``: what is written while the stream has been silent for the server's
    ``stream_keep_alive`` seconds (server/keep_alive.py)."""
    finals: list[StreamDelta] = []  # each choice's last delta; the request ends with all n
    try:
        await stream.accepted()  # a refusal becomes a 4xx before headers go out
        writer = SSEWriter(request)
        await writer.open()
        try:
            async with keeping_alive(writer, state.stream_keep_alive, keep_alive):
                for frame in fmt.opening():
                    await writer.send(frame)
                for frame in fmt.admitted(await stream.admitted()):
                    await writer.send(frame)
                delta = await _next(stream)
                while delta is not None:
                    for frame in fmt.frames(delta):
                        await writer.send(frame)
                    if delta.finished:
                        finals.append(delta)
                        state.metrics.observe_finished(delta.metrics)
                        if len(finals) == choices:
                            break
                    delta = await _next(stream)
            if len(finals) == choices:
                for frame in fmt.closing(sorted(finals, key=lambda d: d.index)):
                    await writer.send(frame)
            await writer.done(done_marker)
            outcome = outcome_of(*(d.finish_reason for d in finals))
            request[OUTCOME] = "abort" if len(finals) < choices else outcome
        except ENGINE_ERRORS as exc:
            # Headers are gone: report the failure in-band, as other OpenAI servers do.
            request[OUTCOME] = "error"
            await writer.send(error_frame(from_engine_error(exc)))
            await writer.done(done_marker)
        return writer.response
    except ClientGone:
        request[OUTCOME] = "abort"
        return writer.response
    finally:
        await stream.aclose()
