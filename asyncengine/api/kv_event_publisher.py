"""Publish the radix cache's KV events over ZMQ (``kv_events = "tcp://127.0.0.1:5557"``).

Each landed step's events (cache/kv_events.py) go out as one ``KVEventBatch``, as vLLM's
publisher sends them: a PUB socket, multipart ``(topic, sequence number as 8 bytes big-endian,
msgpack payload)``. A subscriber that joins late, or falls behind the send buffer, misses
events (PUB drops them); it can ask for a reset (``reset_prefix_cache``), which publishes
``AllBlocksCleared``, and rebuild from there. vLLM's replay socket is not provided.

Anyone who can connect to the endpoint reads what it publishes, so ``BlockStored`` events carry
no token ids (an empty list) unless ``token_ids`` (config ``kv_events_token_ids``) is set: the
chained page hashes are what a router matches prompts on, and they do not give the prompts
away. Bind a loopback address unless the subscribers are on other machines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import msgspec

from asyncengine.cache.kv_events import BlockStored, KVEvent, KVEventBatch, encode_batch

log = logging.getLogger("asyncengine.kv_events")

SEND_BUFFER = 100_000  # messages queued for slow subscribers before PUB drops


class KVEventPublisher:
    def __init__(self, endpoint: str, topic: str = "", *, token_ids: bool = False) -> None:
        self.token_ids = token_ids
        import zmq

        self._zmq = zmq
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_BUFFER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"kv_events: cannot bind {endpoint!r}: {exc}") from None
        self.endpoint = str(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))
        self._topic = topic.encode()
        self.sequence = 0
        log.info("KV cache events published on %s", self.endpoint)

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Send ``events`` as one batch (nothing when there are none)."""
        if not events:
            return
        if not self.token_ids:
            events = [_without_tokens(e) if isinstance(e, BlockStored) else e for e in events]
        payload = encode_batch(KVEventBatch(time.time(), list(events)))
        seq = self.sequence.to_bytes(8, "big")
        try:
            self._socket.send_multipart((self._topic, seq, payload), flags=self._zmq.NOBLOCK)
        except self._zmq.Again:  # every subscriber's buffer is full: dropped, as PUB does
            log.warning("KV events batch %d dropped: subscribers are behind", self.sequence)
        self.sequence += 1

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def _without_tokens(event: BlockStored) -> BlockStored:
    return msgspec.structs.replace(event, token_ids=[])
