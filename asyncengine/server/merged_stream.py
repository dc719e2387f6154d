"""Several engine requests read as one stream: a completions request that batches prompts.

Prompt ``i``'s choice ``j`` becomes choice ``i * n + j`` (OpenAI's numbering). Deltas come in
the order they are produced, whichever request produced them; closing the merged stream closes
(so aborts, unless they finished) every request in it.
"""

from __future__ import annotations

import asyncio
import dataclasses

from asyncengine.api.engine_client import DeltaStream
from asyncengine.common.outputs import StreamDelta


class MergedStream:
    def __init__(self, streams: list[DeltaStream], n: int) -> None:
        self.streams = streams
        self.n = n
        self._pending: dict[asyncio.Future[StreamDelta], int] = {}
        self._open = set(range(len(streams)))

    def __aiter__(self) -> MergedStream:
        return self

    async def accepted(self) -> None:
        await asyncio.gather(*(stream.accepted() for stream in self.streams))

    async def admitted(self) -> int | None:
        """None at once: the prompts' deltas say what each read from the prefix cache."""
        return None

    async def __anext__(self) -> StreamDelta:
        for i in self._open - set(self._pending.values()):
            self._pending[asyncio.ensure_future(self.streams[i].__anext__())] = i
        while self._pending:
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            future = next(iter(done))  # one at a time: the others are taken on later calls
            i = self._pending.pop(future)
            try:
                delta = future.result()
            except StopAsyncIteration:
                self._open.discard(i)
                continue
            return dataclasses.replace(delta, index=i * self.n + delta.index)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        for stream in self.streams:
            await stream.aclose()
