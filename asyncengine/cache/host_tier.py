"""HostTier: a second, larger and slower tier under the prefix cache, in host memory.

When the radix tree evicts a leaf, its pages are copied to host pages (the swap space's buffer
and allocator, shared with swap preemption: swap_space.py) instead of being lost; a later prompt
whose prefix runs on past what the tree holds finds the next pages here and has them copied
back into fresh pool pages (before that step's forward, in the plan's ``swap_in``) instead of
computing them again. The copied-back pages join the tree, so the tree holds the pool tier and
this index the host tier: a page is found by its chained hash (kv_events.page_hashes, the
tokens of the whole prefix up to its end), in least-recently-used order, bounded by the host
buffer. KV events say which tier a page moved to: ``BlockStored(..., medium="cpu")`` when the
tier takes pages, ``BlockRemoved(..., medium="cpu")`` when it drops them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from asyncengine.cache.kv_events import BlockRemoved, BlockStored, page_hashes
from asyncengine.cache.radix_cache import RadixCache, RadixNode
from asyncengine.cache.swap_space import SwapSpace

MEDIUM = "cpu"


class HostTier:
    def __init__(self, swap: SwapSpace, tree: RadixCache) -> None:
        self.swap = swap
        self.tree = tree
        self.page_size = tree.page_size
        self._pages: OrderedDict[int, int] = OrderedDict()  # chained page hash -> host page
        self.stored_pages = 0
        self.loaded_pages = 0
        self.dropped_pages = 0

    def __len__(self) -> int:
        return len(self._pages)

    def _path_tokens(self, node: RadixNode) -> list[int]:
        keys: list[tuple[int, ...]] = []
        while node is not self.tree.root:
            keys.append(node.key)
            parent = node.parent
            assert parent is not None, "the node left the tree"
            node = parent
        tokens: list[int] = []
        for key in reversed(keys):
            tokens.extend(key)
        return tokens

    def store(self, node: RadixNode) -> None:
        """Copy the pages of ``node`` (a leaf the tree is evicting, still attached) to host
        pages, the shallowest first, dropping the least recently used host pages for room."""
        ps = self.page_size
        pages = node.value.tolist()
        tokens = self._path_tokens(node)
        chain = page_hashes(tokens, ps)
        first = len(chain) - len(pages)  # the node's first page, counted from the root
        missing: list[int] = []  # indexes into chain
        for index in range(first, len(chain)):
            if chain[index] in self._pages:
                self._pages.move_to_end(chain[index])
            else:
                missing.append(index)
        if not missing:
            return
        short = len(missing) - self.swap.num_free
        if short > 0:
            self._drop(short)  # freed two plans from now: this store takes what is free
        taken = missing[: self.swap.num_free]
        if not taken:
            return
        host = self.swap.store([pages[index - first] for index in taken])
        for index, host_page in zip(taken, host, strict=True):
            self._pages[chain[index]] = host_page
            parent = chain[index - 1] if index else None
            page_tokens = tokens[index * ps : (index + 1) * ps]
            self.tree.record(BlockStored([chain[index]], parent, page_tokens, ps, None, MEDIUM))
        self.stored_pages += len(taken)

    def _drop(self, count: int) -> None:
        dropped = [self._pages.popitem(last=False) for _ in range(min(count, len(self._pages)))]
        if dropped:
            self.swap.release([host for _, host in dropped])
            self.dropped_pages += len(dropped)
            self.tree.record(BlockRemoved([h for h, _ in dropped], MEDIUM))

    def lookup(self, tokens: Sequence[int] | np.ndarray, start: int, end: int) -> list[int]:
        """Host pages of the whole pages of ``tokens[start:end]`` (``start`` page aligned), in
        order, up to the first one the tier does not hold."""
        if not self._pages or end - start < self.page_size:
            return []
        prefix = tokens[:end]
        hashes = page_hashes(
            prefix.tolist() if isinstance(prefix, np.ndarray) else prefix, self.page_size
        )
        found: list[int] = []
        for h in hashes[start // self.page_size :]:
            host = self._pages.get(h)
            if host is None:
                break
            self._pages.move_to_end(h)
            found.append(host)
        return found

    def load(self, host_pages: list[int], pool_pages: list[int]) -> None:
        self.swap.load(host_pages, pool_pages)
        self.loaded_pages += len(host_pages)

    def clear(self) -> None:
        self._drop(len(self._pages))

    def stats(self) -> dict[str, int]:
        return {
            "host_tier_pages": len(self._pages),
            "host_tier_stored_pages": self.stored_pages,
            "host_tier_loaded_pages": self.loaded_pages,
            "host_tier_dropped_pages": self.dropped_pages,
        }
