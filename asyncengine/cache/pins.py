"""Pinned prefixes: cached prompt prefixes (a system prompt, a few-shot block) kept out of
eviction until unpinned or past their time to live.

A pin locks its node in the radix tree as a live sequence does, so the pages on its path stay
the tree's and are never evicted; the page accounting invariant counts it as one more lock. A
pin counts every page on its path against ``max_pages`` (a page two pins share counts twice:
the bound errs on the side of keeping the pool for requests)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from asyncengine.cache.radix_cache import RadixNode


class PinLimitError(ValueError):
    """A pin beyond the pool's pinned share, or of nothing cached."""


@dataclass(slots=True)
class Pin:
    pin_id: int
    node: RadixNode
    tokens: int  # cached tokens it keeps (whole pages)
    pages: int
    expires_at: float | None  # on the engine's clock; None: until unpinned


class PinnedPrefixes:
    def __init__(self, max_pages: int) -> None:
        self.max_pages = max_pages
        self._pins: dict[int, Pin] = {}
        self._ids = itertools.count(1)
        self.expired = 0

    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._pins.values()))

    @property
    def pages(self) -> int:
        return sum(pin.pages for pin in self._pins.values())

    def check_room(self, pages: int) -> None:
        if pages > self.max_pages:  # unpinning would not make room
            raise PinLimitError(
                f"a pin of {pages} pages is more than the pool's pinned share of "
                f"{self.max_pages} pages; raise max_pinned_fraction or pin a shorter prefix"
            )
        if self.pages + pages > self.max_pages:
            raise PinLimitError(
                f"pinning {pages} more pages would hold {self.pages + pages} of the pool's "
                f"pinned share of {self.max_pages} pages (max_pinned_fraction); unpin first"
            )

    def add(self, node: RadixNode, page_size: int, expires_at: float | None) -> Pin:
        pages = node.prefix_len // page_size
        self.check_room(pages)
        pin = Pin(next(self._ids), node, node.prefix_len, pages, expires_at)
        self._pins[pin.pin_id] = pin
        return pin

    def remove(self, pin_id: int) -> Pin:
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            raise KeyError(f"no pin {pin_id}")
        return pin

    def due(self, now: float) -> list[Pin]:
        """The pins whose time to live has passed (taken out)."""
        gone = [p for p in self._pins.values() if p.expires_at is not None and p.expires_at <= now]
        for pin in gone:
            del self._pins[pin.pin_id]
        self.expired += len(gone)
        return gone

    def next_expiry(self) -> float | None:
        """When the first time to live ends (None: no pin has one)."""
        ends = [p.expires_at for p in self._pins.values() if p.expires_at is not None]
        return min(ends, default=None)

    def clear(self) -> list[Pin]:
        pins = list(self._pins.values())
        self._pins.clear()
        return pins
