"""Server-sent events: ``data: <json>\\n\\n`` frames ending with ``data: [DONE]\\n\\n`` (OpenAI's),
or named ones, ``event: <name>\\ndata: <json>\\n\\n``, that end with the stream (Anthropic's)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from asyncengine.server.connection_limits import LIMITS, WriteTimeoutError, write_within

DONE_FRAME = b"data: [DONE]\n\n"

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    # Tell reverse proxies (nginx) not to buffer the stream.
    "X-Accel-Buffering": "no",
}


class ClientGone(Exception):
    """The client closed the connection while we were streaming to it."""


@dataclass(frozen=True, slots=True)
class NamedEvent:
    """A frame sent with an ``event:`` line (clients that dispatch on it need one)."""

    name: str
    payload: Any


def frame(payload: Any) -> bytes:
    if isinstance(payload, NamedEvent):
        data = msgspec.json.encode(payload.payload)
        return b"event: " + payload.name.encode() + b"\ndata: " + data + b"\n\n"
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class SSEWriter:
    """Writes SSE frames to one response; a failed write raises ClientGone."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        self.last_write = asyncio.get_running_loop().time()  # when a write last began or ended
        self.writes_waiting = 0  # writes not yet taken by the client's socket

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, payload: Any) -> None:
        await self._write(frame(payload))

    async def done(self, marker: bool = True) -> None:
        """End the stream, with ``data: [DONE]`` first unless ``marker`` is false."""
        await self._write(DONE_FRAME if marker else b"", eof=True)

    async def write_raw(self, data: bytes) -> None:
        """Write bytes that are already SSE (a keep-alive)."""
        await self._write(data)

    async def _write(self, data: bytes, eof: bool = False) -> None:
        limits = self._request.app.get(LIMITS)
        loop = asyncio.get_running_loop()
        self.last_write = loop.time()
        self.writes_waiting += 1
        try:
            if limits is None:
                await self.response.write(data)
            else:  # a client that stopped reading is dropped after the write timeout
                await write_within(self._request, limits.write_timeout, self.response.write(data))
            if eof:
                await self.response.write_eof()
        except (ConnectionResetError, RuntimeError, WriteTimeoutError) as exc:
            # ConnectionResetError: the transport is closing; RuntimeError: it is already gone.
            raise ClientGone(str(exc)) from exc
        finally:
            self.writes_waiting -= 1
            self.last_write = loop.time()
