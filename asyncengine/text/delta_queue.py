"""DeltaQueue: one reader's queue of stream deltas, the part of ``asyncio.Queue`` a stream uses
(``put_nowait``, ``get``, ``get_nowait``, ``empty``, ``qsize``, and ``peek``), without its
size bound, task counting and waiter lists: a token of every running request passes through one
each step. ``wait`` and ``wake`` let its reader wait for news that is not an item (its request
scheduled)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class DeltaQueue(Generic[T]):
    """Unbounded FIFO with at most one waiting reader (a stream has one)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        self.wake()

    def wake(self) -> None:
        """Wake the waiting reader, if any (an item may not have come: it checks again)."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Return at once if an item is in; else once one comes or ``wake`` is called."""
        if self._items:
            return
        if self._waiter is not None:
            raise RuntimeError("a DeltaQueue has one reader at a time")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            if self._waiter is waiter:  # cancelled before an item came
                self._waiter = None

    async def get(self) -> T:
        items = self._items
        while not items:
            await self.wait()
        return items.popleft()

    def get_nowait(self) -> T:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def peek(self) -> T | None:
        """The next item, left in the queue (None when it is empty)."""
        return self._items[0] if self._items else None

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
