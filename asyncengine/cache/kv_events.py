"""KV cache events: what the radix cache stores and removes, in vLLM's event shape, for routers
outside the engine (llm-d, Dynamo, our own ``routing/``) to route on real cache contents.

A block is one page. Its hash chains over the prefix: ``page_hashes`` hashes each whole page of
tokens with the hash of the page before it (blake2b, 63 bits, the same in every process), so a
router computes the hashes of a request's prompt and looks them up in what replicas reported.
The events (msgspec structs, msgpack arrays tagged with their class name, as vLLM's):

- ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)``: pages
  that entered the tree, in order, after the page ``parent_block_hash`` (None: from the start);
- ``BlockRemoved(block_hashes, medium)``: pages evicted;
- ``AllBlocksCleared()``: the tree was emptied (reset).

``KVEventBatch(ts, events, data_parallel_rank)`` is what one publication carries
(kv_event_publisher.py sends it over ZMQ).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgspec

HASH_MASK = (1 << 63) - 1  # msgpack and other languages' int64 take it as is
_ROOT_SEED = 0


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the cache (tagged with its class name on the wire)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def page_hashes(tokens: Sequence[int], page_size: int, parent: int | None = None) -> list[int]:
    """The chained hashes of the whole pages of ``tokens``, which follow the page ``parent``
    (None: ``tokens`` start at position 0)."""
    out: list[int] = []
    previous = _ROOT_SEED if parent is None else parent
    pack = struct.Struct(f"<Q{page_size}q").pack
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        data = pack(previous, *tokens[start : start + page_size])
        digest = hashlib.blake2b(data, digest_size=8).digest()
        previous = int.from_bytes(digest, "little") & HASH_MASK
        out.append(previous)
    return out


def decode_batch(payload: bytes) -> KVEventBatch:
    """A publication's payload, as a subscriber reads it."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return msgspec.msgpack.encode(batch)
