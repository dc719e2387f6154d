"""Keep-alives for a stream that has sent nothing for a while (a long prefill, a queue).

Clients and proxies with read timeouts (60 s in nginx, 600 s in the OpenAI and Anthropic
clients) give up on a stream that sends nothing, and the work is lost. While a stream has been
silent for ``interval`` seconds one beat writes a frame its clients ignore: an SSE comment line
(the protocol's keep-alive) or, on Anthropic's route, a ``ping`` event as Anthropic's API sends.
One timer a stream, waking once an interval; it ends with the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

from asyncengine.server.sse import ClientGone, NamedEvent, SSEWriter, frame

DEFAULT_KEEP_ALIVE_SECONDS = 15.0

# A comment line: clients skip it (the SSE spec; openai and anthropic's decoders alike).
COMMENT_FRAME = b": keep-alive\n\n"
# Anthropic's keep-alive event; its clients skip it, before ``message_start`` too.
PING_FRAME = frame(NamedEvent("ping", {"type": "ping"}))


def check_keep_alive(interval: float) -> None:
    """Refuse an interval that is negative or not a number (0 turns keep-alives off)."""
    if not math.isfinite(interval) or interval < 0:
        raise ValueError("stream_keep_alive must be a finite number of seconds >= 0 (0: off)")


async def _beat(writer: SSEWriter, interval: float, keep_alive: bytes) -> None:
    loop = asyncio.get_running_loop()
    while True:
        silent_for = loop.time() - writer.last_write
        if silent_for < interval:
            await asyncio.sleep(interval - silent_for)
        elif writer.writes_waiting:  # a write waits on a slow reader: the stream is not silent
            await asyncio.sleep(interval)
        else:
            try:
                await writer.write_raw(keep_alive)
            except ClientGone:
                return  # the stream's own next write finds it out


@contextlib.asynccontextmanager
async def keeping_alive(
    writer: SSEWriter, interval: float, keep_alive: bytes = COMMENT_FRAME
) -> AsyncIterator[None]:
    """Write ``keep_alive`` whenever ``writer`` has sent nothing for ``interval`` seconds
    (0: never) while the block runs; the beat is cancelled and awaited when it ends."""
    if interval <= 0:
        yield
        return
    beat = asyncio.create_task(_beat(writer, interval, keep_alive))
    try:
        yield
    finally:
        beat.cancel()
        await asyncio.wait({beat})  # gone before the stream's last write (write_eof)
