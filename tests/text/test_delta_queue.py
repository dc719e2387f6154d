"""DeltaQueue: a stream's one-reader FIFO (what it keeps of asyncio.Queue's behaviour)."""

from __future__ import annotations

import asyncio

import pytest

from asyncengine.text.delta_queue import DeltaQueue


def test_items_come_out_in_order_and_a_reader_waits_for_the_next() -> None:
    async def main() -> list[int]:
        queue: DeltaQueue[int] = DeltaQueue()
        queue.put_nowait(1)
        queue.put_nowait(2)
        got = [await queue.get(), await queue.get()]
        assert queue.empty() and queue.qsize() == 0
        reader = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        assert not reader.done()  # nothing to read: it waits
        queue.put_nowait(3)
        queue.put_nowait(4)
        got.append(await reader)
        assert queue.qsize() == 1
        got.append(queue.get_nowait())
        return got

    assert asyncio.run(main()) == [1, 2, 3, 4]


def test_a_cancelled_reader_leaves_the_queue_usable() -> None:
    async def main() -> int:
        queue: DeltaQueue[int] = DeltaQueue()
        reader = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        queue.put_nowait(7)  # no waiter left to wake: the item stays
        return await queue.get()

    assert asyncio.run(main()) == 7


def test_one_reader_at_a_time_and_get_nowait_on_empty() -> None:
    async def main() -> None:
        queue: DeltaQueue[int] = DeltaQueue()
        with pytest.raises(asyncio.QueueEmpty):
            queue.get_nowait()
        first = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one reader"):
            await queue.get()
        queue.put_nowait(1)
        assert await first == 1

    asyncio.run(main())
