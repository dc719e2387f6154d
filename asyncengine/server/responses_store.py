"""The responses kept for ``GET /v1/responses/{id}`` and ``previous_response_id``: in memory,
bounded by size and age.

Each stored response keeps its body (what GET answers) and its turn of the conversation (its
input items, which ``GET /v1/responses/{id}/input_items`` lists, and its output as items) with
a link to the response it continued, so a chain costs the size of its turns, not the square of
its length. Both are kept as their JSON bytes (decoded when read): the store's memory is the
size it counts, where decoded objects would take several times their JSON. A response leaves
the store ``ttl`` seconds after it was stored, or earlier when the store would exceed
``max_bytes`` (the JSON size of bodies and turns): the oldest of the owner (API key) holding
the most bytes goes first, so a key that fills the store evicts its own responses, not another
key's. A chain one of whose responses has left cannot be continued (404, as an unknown id).
A chain is continued only while it holds at most ``MAX_CONVERSATION_ITEMS`` items and at most
the request body limit in JSON bytes (else a 400): what a request could send as ``input``, so
that a small request costs no more to read its conversation than a large one. Ids are random
(128 bits); behind API keys a response belongs to the key that made it (``owner``, its digest):
another key's GET (of it or its input items), DELETE or continuation gets a 404, as for an
unknown id. A response stored with a ``user`` is continued only by requests of that user.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncengine.server.errors import ApiError, invalid_request
from asyncengine.server.responses_schema import MAX_CONVERSATION_ITEMS, InputItem

Json = dict[str, Any]

DEFAULT_STORE_BYTES = 64 * 1024 * 1024
DEFAULT_STORE_TTL_SECONDS = 3600.0


_TURN = msgspec.json.Decoder(list[InputItem])


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: bytes  # the response's JSON, as GET answers it
    turn: bytes  # the JSON of its input items (the first ``inputs``), then its output items
    inputs: int
    count: int  # the items of its turn
    previous: str | None
    owner: str | None  # the digest of the API key that made it (None: no keys)
    tenant: str | None  # its request's ``user``
    expires: float
    size: int

    @property
    def items(self) -> list[InputItem]:
        """Its turn of the conversation: its input items, then its output items."""
        return _TURN.decode(self.turn)

    @property
    def input_items(self) -> list[InputItem]:
        """What its request sent as ``input`` (not the items of the responses it continued)."""
        return self.items[: self.inputs]


class ResponseStore:
    def __init__(
        self,
        max_bytes: int = DEFAULT_STORE_BYTES,
        ttl: float = DEFAULT_STORE_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 0:
            raise ValueError("the responses store size must be >= 0 bytes")
        if ttl <= 0:
            raise ValueError("the responses store TTL must be > 0 seconds")
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._owned: dict[str | None, OrderedDict[str, None]] = {}  # each owner's, oldest first
        self._owner_bytes: dict[str | None, int] = {}
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(
        self,
        response_id: str,
        body: Json,
        turn: list[InputItem],
        previous: str | None,
        owner: str | None,
        tenant: str | None,
        *,
        inputs: int,
    ) -> bool:
        """Keep a response (``inputs``: how many of ``turn``'s first items were its input);
        False when it alone is larger than the store."""
        body_json = _exact(msgspec.json.encode(body))
        turn_json = _exact(msgspec.json.encode(turn))
        size = len(body_json) + len(turn_json)
        if size > self.max_bytes:
            return False
        self._expire()
        while self._entries and self.bytes + size > self.max_bytes:
            largest = max(self._owner_bytes, key=self._owner_bytes.__getitem__)
            self._drop(next(iter(self._owned[largest])))
        expires = self._clock() + self.ttl
        self._entries[response_id] = StoredResponse(
            body_json, turn_json, inputs, len(turn), previous, owner, tenant, expires, size
        )
        self._owned.setdefault(owner, OrderedDict())[response_id] = None
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
        self.bytes += size
        return True

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The response, when it is stored and ``owner``'s."""
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, response_id: str, owner: str | None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    def conversation(
        self, response_id: str, owner: str | None, tenant: str | None, max_bytes: int
    ) -> list[InputItem]:
        """The items of the chain that ends with ``response_id``, oldest first; 404 when it
        (or a response before it) is not stored, or was stored by another key or user; 400
        when it holds more than ``MAX_CONVERSATION_ITEMS`` items or ``max_bytes`` of JSON.
        The chain is walked and measured before any of it is decoded."""
        head = self.get(response_id, owner)
        if head is None or head.tenant != tenant:
            raise not_found(response_id, "previous_response_id")
        chain: list[StoredResponse] = []
        count = size = 0
        entry: StoredResponse | None = head
        while entry is not None:
            chain.append(entry)
            count, size = count + entry.count, size + len(entry.turn)
            if count > MAX_CONVERSATION_ITEMS or size > max_bytes:
                raise _too_long(response_id, max_bytes)
            if entry.previous is None:
                break
            entry = self._entries.get(entry.previous)
            if entry is None:
                raise ApiError(
                    404,
                    f"the conversation of response {response_id!r} reaches back to a response "
                    "that is no longer stored (it expired or was evicted)",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
        return [item for entry in reversed(chain) for item in entry.items]

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires > now:
                break
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        self.bytes -= entry.size
        owned = self._owned[entry.owner]
        del owned[response_id]
        self._owner_bytes[entry.owner] -= entry.size
        if not owned:
            del self._owned[entry.owner], self._owner_bytes[entry.owner]


def _exact(encoded: bytes) -> bytes:
    """A copy of exactly its length: msgspec's output keeps its spare buffer (up to half again)."""
    return bytes(memoryview(encoded))


def _too_long(response_id: str, max_bytes: int) -> ApiError:
    return invalid_request(
        f"the conversation of response {response_id!r} holds more than "
        f"{MAX_CONVERSATION_ITEMS} items or {max_bytes} bytes of JSON (the request body "
        "limit): start a new one, with the items to keep as input",
        param="previous_response_id",
        code="conversation_too_long",
    )


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"no response with id {response_id!r} is stored (unknown, expired, deleted, or made "
        "with store: false)",
        param=param,
        code="response_not_found",
    )
