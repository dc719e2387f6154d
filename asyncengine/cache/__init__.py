"""KV memory accounting (no torch): page allocator, page table, radix prefix cache, and the
manager that owns their accounting. The K/V tensors themselves are the executor's
(asyncengine/executor/kv_pool.py)."""

from __future__ import annotations

from asyncengine.cache.allocator import InvalidFreeError, OutOfPagesError, PageAllocator
from asyncengine.cache.manager import KVCacheManager, SeqKV
from asyncengine.cache.page_table import OutOfRowsError, PageTable
from asyncengine.cache.radix_cache import RadixCache, RadixNode

__all__ = [
    "InvalidFreeError",
    "KVCacheManager",
    "OutOfPagesError",
    "OutOfRowsError",
    "PageAllocator",
    "PageTable",
    "RadixCache",
    "RadixNode",
    "SeqKV",
]
