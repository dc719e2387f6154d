"""SwapSpace: the accounting of the host buffer that preempted requests' KV is swapped into.

With ``preemption_mode = "swap"`` a request retracted for KV memory has its computed KV pages
copied to host pages (a separate tensor area the executor holds: CPU memory, pinned on a GPU)
before its pool pages are released, and copied back into fresh pool pages when it is admitted
again, so nothing is recomputed. Only page ids live here; the executor does the copies, in the
order of each plan's ``swap_out`` then ``swap_in`` lists (plan.py ``SwapCopy``).

The host tier under the prefix cache (host_tier.py) takes its pages from the same allocator:
``store`` copies evicted pool pages out, ``load`` copies them back into fresh pool pages on a
hit, ``release`` gives them up; its copies ride in the same lists.

Invariant (``check``): every host page is exactly one of free, held by one swapped-out request
(``SwappedKV.host_pages``), held by the host tier, or released by a swap-in whose plan may not have run yet
(``_releasing``: a host page is only reused once the copy that reads it has run, i.e. from
the plan after next, since plans execute in order and each is planned after the previous
one landed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncengine.cache.allocator import PageAllocator
from asyncengine.common.plan import SwapCopy


@dataclass(slots=True, eq=False)
class SwappedKV:
    """A swapped-out request's KV: positions ``0 .. computed_len - 1`` in ``host_pages``."""

    host_pages: list[int]
    computed_len: int


@dataclass(slots=True)
class SwapCounters:
    swap_outs: int = 0
    swap_ins: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    swap_full: int = 0  # swap-outs refused for want of host pages (recomputed instead)
    tier_out_bytes: int = 0  # evicted prefix-cache pages copied to the host tier
    tier_in_bytes: int = 0  # host-tier pages copied back on a prefix-cache hit


class SwapSpace:
    def __init__(self, num_pages: int, page_bytes: int) -> None:
        self.num_pages = num_pages
        self.page_bytes = page_bytes  # K and V of one page across all layers
        self.allocator = PageAllocator(num_pages)
        self.counters = SwapCounters()
        self._held: dict[int, SwappedKV] = {}  # id -> live swapped-out KV
        self._tier: set[int] = set()  # host pages the prefix cache's host tier holds
        self._releasing: list[np.ndarray] = []  # read by the plan being built now
        self._released_next: list[np.ndarray] = []  # read by the last plan handed out
        self._out: list[SwapCopy] = []
        self._in: list[SwapCopy] = []

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def swap_out(self, pool_pages: list[int], computed_len: int) -> SwappedKV | None:
        """Host pages for ``pool_pages`` (which hold positions 0 .. computed_len - 1), and the
        copy recorded for the next plan; None (nothing recorded) when they do not fit."""
        n = len(pool_pages)
        if n > self.allocator.num_free:
            self.counters.swap_full += 1
            return None
        host = self.allocator.alloc_ids(n)
        self._out.append(SwapCopy(list(pool_pages), host))
        swapped = SwappedKV(host, computed_len)
        self._held[id(swapped)] = swapped
        self.counters.swap_outs += 1
        self.counters.swapped_out_bytes += n * self.page_bytes
        return swapped

    def swap_in(self, swapped: SwappedKV, first_page: int, pool_pages: list[int]) -> None:
        """Copy host pages ``first_page ..`` of ``swapped`` into ``pool_pages`` in the next plan
        (the pages before ``first_page`` came from the prefix cache) and release its host pages
        once that plan has run."""
        self._take(swapped)
        host = swapped.host_pages[first_page:]
        assert len(host) == len(pool_pages), (len(host), len(pool_pages))
        if host:
            self._in.append(SwapCopy(list(pool_pages), host))
        self._releasing.append(np.asarray(swapped.host_pages, dtype=np.int32))
        self.counters.swap_ins += 1
        self.counters.swapped_in_bytes += len(host) * self.page_bytes

    def store(self, pool_pages: list[int]) -> list[int]:
        """Host pages for the host tier, and the copy of ``pool_pages`` into them recorded for
        the next plan (the caller checked ``num_free``)."""
        host = self.allocator.alloc_ids(len(pool_pages))
        self._tier.update(host)
        self._out.append(SwapCopy(list(pool_pages), host))
        self.counters.tier_out_bytes += len(host) * self.page_bytes
        return host

    def load(self, host_pages: list[int], pool_pages: list[int]) -> None:
        """Copy host-tier pages back into ``pool_pages`` in the next plan (they stay held)."""
        assert len(host_pages) == len(pool_pages) and self._tier.issuperset(host_pages)
        self._in.append(SwapCopy(list(pool_pages), list(host_pages)))
        self.counters.tier_in_bytes += len(host_pages) * self.page_bytes

    def release(self, host_pages: list[int]) -> None:
        """The host tier gives pages up: free once no plan handed out can still read them."""
        self._tier.difference_update(host_pages)
        self._releasing.append(np.asarray(host_pages, dtype=np.int32))

    def drop(self, swapped: SwappedKV) -> None:
        """A swapped-out request ended while waiting: its host pages are free again (no plan
        reads them; a copy-out still pending only writes them)."""
        self._take(swapped)
        self._releasing.append(np.asarray(swapped.host_pages, dtype=np.int32))

    def _take(self, swapped: SwappedKV) -> None:
        if self._held.pop(id(swapped), None) is None:
            raise ValueError("swapped-out KV is not held by this swap space (used twice?)")

    def drain(self) -> tuple[list[SwapCopy], list[SwapCopy]]:
        """The copies of the plan being handed out; host pages the previous plan read are
        free from now on."""
        for pages in self._released_next:
            self.allocator.free(pages)
        self._released_next, self._releasing = self._releasing, []
        out, into = self._out, self._in
        self._out, self._in = [], []
        return out, into

    def check(self) -> None:
        """Assert the host-page invariant (see the module docstring)."""
        owner = np.zeros(self.num_pages, dtype=np.int64)
        free = self.allocator.free_pages()
        owner[free] += 1
        for swapped in self._held.values():
            owner[np.asarray(swapped.host_pages, dtype=np.int64)] += 1
        owner[np.fromiter(self._tier, dtype=np.int64, count=len(self._tier))] += 1
        for pages in self._releasing + self._released_next:
            owner[pages] += 1
        twice = np.flatnonzero(owner > 1)
        assert twice.size == 0, f"host swap pages {twice[:8].tolist()} have two owners"
        nobody = np.flatnonzero(owner == 0)
        assert nobody.size == 0, f"host swap pages {nobody[:8].tolist()} leaked"

    def stats(self) -> dict[str, int]:
        c = self.counters
        return {
            "swap_pages_total": self.num_pages,
            "swap_pages_used": sum(len(s.host_pages) for s in self._held.values()),
            "swap_outs": c.swap_outs,
            "swap_ins": c.swap_ins,
            "swapped_out_bytes": c.swapped_out_bytes,
            "swapped_in_bytes": c.swapped_in_bytes,
            "swap_full": c.swap_full,
            "tier_pages_used": len(self._tier),
            "tier_out_bytes": c.tier_out_bytes,
            "tier_in_bytes": c.tier_in_bytes,
        }
