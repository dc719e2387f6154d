"""KV memory: page allocator, page table, KV pool tensors, radix prefix cache, and the manager
that owns their accounting."""

from __future__ import annotations

from asyncengine.cache.allocator import InvalidFreeError, OutOfPagesError, PageAllocator
from asyncengine.cache.kv_pool import KVPool
from asyncengine.cache.manager import KVCacheManager, SeqKV
from asyncengine.cache.page_table import OutOfRowsError, PageTable
from asyncengine.cache.radix_cache import RadixCache, RadixNode

__all__ = [
    "InvalidFreeError",
    "KVCacheManager",
    "KVPool",
    "OutOfPagesError",
    "OutOfRowsError",
    "PageAllocator",
    "PageTable",
    "RadixCache",
    "RadixNode",
    "SeqKV",
]
