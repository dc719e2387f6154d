"""WaitingQueue: the scheduler's waiting requests, in the order admission tries them.

Arrivals join at the end, retracted requests go to the front, and admission takes requests out
of the head's window, not always the head itself (a policy may admit them in another order, or
pass one over). As a list, each admission cost a scan of the queue (``list.remove``): 0.4 ms a
request with half a million waiting, minutes over an overloaded million-request simulation.
Here every one of those operations is O(1) (an ordered dict whose keys are the requests, which
hash and compare by identity), and the ``n`` oldest cost O(n): a walk of the keys, which an
``OrderedDict`` does without the lookup per item its values would cost.

It is a read-only ``Sequence[Request]`` to policies (``Policy.candidates``): iteration, ``len``,
``in``, ``queue[0]``, ``queue[-1]`` and slices from the front (``queue[:n]``) as on a list;
other indexes walk the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import overload

from asyncengine.common.request import Request


class WaitingQueue(Sequence[Request]):
    __slots__ = ("_head", "_head_n", "_items")

    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self._items: OrderedDict[Request, None] = OrderedDict.fromkeys(requests)
        self._head: list[Request] | None = None  # what head() gave, until the head changes
        self._head_n = 0

    # -- changes (the scheduler's) --------------------------------------------------------
    def append(self, req: Request) -> None:
        """``req`` joins at the end (ValueError when it is already queued)."""
        if req in self._items:
            raise ValueError(f"request {req.rid!r} is already waiting")
        self._items[req] = None

    def push_front(self, req: Request) -> None:
        """``req`` goes before every other (a retracted request)."""
        self.append(req)
        self._items.move_to_end(req, last=False)
        self._head = None

    def remove(self, req: Request) -> None:
        """Take ``req`` out wherever it is (ValueError when it is not queued)."""
        try:
            del self._items[req]
        except KeyError:
            raise ValueError(f"request {req.rid!r} is not waiting") from None
        self._head = None

    # -- reading --------------------------------------------------------------------------
    def oldest(self, n: int) -> list[Request]:
        """The first ``n`` requests in queue order (a new list)."""
        return list(self.head(n))

    def head(self, n: int) -> list[Request]:
        """``oldest(n)``, one list shared by the calls between which the queue's first ``n``
        stay the same (read it, never change it): an overloaded simulation asks every step
        for a window that seldom moves. Only ``push_front`` and ``remove`` move the head;
        ``append`` adds to it only while the queue is shorter than ``n``."""
        head = self._head
        if head is None or n != self._head_n or (len(head) < n and len(head) != len(self)):
            head = self._head = list(islice(self._items, max(0, n)))
            self._head_n = n
        return head

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._items)

    def __contains__(self, req: object) -> bool:
        return isinstance(req, Request) and req in self._items

    def index(self, value: object, start: int = 0, stop: int | None = None) -> int:
        if start < 0 or (stop is not None and stop < 0):
            start, stop, _ = slice(start, stop).indices(len(self))
        for i, req in enumerate(islice(self._items, start, stop), start):
            if req is value:
                return i
        raise ValueError("request is not waiting")

    @overload
    def __getitem__(self, index: int) -> Request: ...

    @overload
    def __getitem__(self, index: slice) -> list[Request]: ...

    def __getitem__(self, index: int | slice) -> Request | list[Request]:
        if index == 0:  # the queue's first (asked every step): head()'s, or one step in
            head = self._head
            if head:
                return head[0]
            if self._items:
                return next(iter(self._items))
        size = len(self._items)
        if isinstance(index, slice):
            start, stop, step = index.indices(size)
            if step == 1:
                if start == 0:  # the head: a copy of head()'s list
                    return list(self.head(stop))
                return list(islice(self._items, start, max(start, stop)))
            return list(self)[index]
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("waiting queue index out of range")
        if index == size - 1:
            return next(reversed(self._items))
        return next(islice(self._items, index, None))

    def __repr__(self) -> str:
        return f"WaitingQueue({[req.rid for req in self]!r})"
