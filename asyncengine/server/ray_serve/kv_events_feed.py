"""KV events from the replicas to a router that consumes them (``--router kv-events``).

Each replica's engine publishes its cache's events on its own ZMQ endpoint (kv_event_publisher.py)
and reports the endpoint in its routing stats; the router ``follow``s each endpoint it sees, and
one thread here reads them all (a SUB socket per replica) and hands every batch to ``deliver``
with the replica's id. Events a replica published before the router subscribed are not seen
(PUB/SUB); a replica starts with an empty cache, so what the router misses is only the time the
subscription takes to connect.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from asyncengine.cache.kv_events import KVEvent, decode_batch

log = logging.getLogger("asyncengine.ray.kv_events")

POLL_MS = 50


class KVEventsFeed:
    def __init__(self, deliver: Callable[[str, Sequence[KVEvent]], None]) -> None:
        self._deliver = deliver
        self._changes: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self._followed: dict[str, str] = {}  # replica id -> endpoint (the caller's view)
        self._stop = threading.Event()
        self.batches = 0
        self._thread = threading.Thread(target=self._run, name="kv-events-feed", daemon=True)
        self._thread.start()

    def follow(self, replica_id: str, endpoint: str) -> None:
        """Subscribe to ``replica_id``'s events at ``endpoint`` (again if it moved)."""
        if self._followed.get(replica_id) != endpoint:
            self._followed[replica_id] = endpoint
            self._changes.put((replica_id, endpoint))

    def drop(self, replica_id: str) -> None:
        if self._followed.pop(replica_id, None) is not None:
            self._changes.put((replica_id, None))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        import zmq

        context = zmq.Context()
        poller = zmq.Poller()
        sockets: dict[str, zmq.Socket] = {}
        owners: dict[zmq.Socket, str] = {}
        try:
            while not self._stop.is_set():
                while not self._changes.empty():
                    replica_id, endpoint = self._changes.get()
                    old = sockets.pop(replica_id, None)
                    if old is not None:
                        poller.unregister(old)
                        owners.pop(old)
                        old.close(linger=0)
                    if endpoint is not None:
                        sub = context.socket(zmq.SUB)
                        sub.setsockopt(zmq.SUBSCRIBE, b"")
                        sub.connect(endpoint)
                        poller.register(sub, zmq.POLLIN)
                        sockets[replica_id] = sub
                        owners[sub] = replica_id
                        log.info("following replica %s's KV events at %s", replica_id, endpoint)
                if not sockets:  # zmq's poll returns at once when it has nothing to poll
                    self._stop.wait(POLL_MS / 1000)
                    continue
                for sub, _ in poller.poll(POLL_MS):
                    _, _, payload = sub.recv_multipart()
                    self.batches += 1
                    self._deliver(owners[sub], decode_batch(payload).events)
        except Exception:
            log.exception("the KV events feed stopped")
        finally:
            for sub in sockets.values():
                sub.close(linger=0)
            context.term()
