"""What one client may learn of another's requests through the prefix cache.

- ``cache_isolation = "api-key"``: every API key gets its own cache namespace: a request's
  ``cache_salt`` is combined with a digest of the key it presented, so clients with different
  keys share no prefix pages (a client's own ``cache_salt`` splits its namespace further); and
  the key, not the request's ``user``, is its tenant.
- ``report_cached_tokens = False``: responses omit ``cached_tokens``.
- With an API key, ``/metrics`` without it leaves out the series that answer "was this prompt
  cached?" or "how much does the cache hold?" (hit/miss and computed-token counters, every
  page gauge but the pool's size, evictions) and the tenant-labelled ones (other clients'
  ``user`` strings); with the key the scrape is whole. Under
  ``cache_isolation = "api-key"`` only the admin token gets the whole scrape (one key must
  learn nothing of the others' caches); the engine figures of ``/server_info`` are then those
  of the open scrape. With API keys only the admin token may flush the prefix cache (one key
  must not empty the others' caches).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import CollectorRegistry

CACHE_ISOLATIONS = ("shared", "api-key")

# request key: the digest of the API key the request presented (auth middleware)
API_KEY_DIGEST: Any = (
    web.RequestKey("asyncengine_api_key_digest", str)
    if hasattr(web, "RequestKey")
    else "asyncengine_api_key_digest"
)

# /metrics families (by a part of the name) that tell whether some prompt was cached, or how
# much of the pool the cache holds: free and used pages give the cached ones (total - free -
# used), evictions and pinned pages happen only to cached pages, the swap seconds count the
# host tier's copies, and an admission held for a shared prefix in flight tells of two prompts
# alike. The pool's size (kv_pages_total, kv_pool_bytes) is all that stays open.
_CACHE_REVEALING = (
    "cache_hit",
    "cache_miss",
    "computed_tokens",
    "kv_pages_cached",
    "kv_pages_evictable",
    "kv_pages_tail",
    "kv_pages_free",
    "kv_pages_used",
    "kv_pages_pinned",
    "eviction_",
    "swap_seconds",
    "admission_blocked",
    "shared_tokens",
    "host_tier",
)


def cache_revealing(metric_name: str) -> bool:
    """Whether a /metrics family (or the engine figure behind it) tells of cached prompts."""
    return any(part in metric_name for part in _CACHE_REVEALING)


def matching_key_digest(header: str, keys: tuple[str, ...]) -> str | None:
    """The digest of the key in an ``Authorization: Bearer <key>`` header, when it is one of
    ``keys``; every key is compared in constant time, whichever matches."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    given = token.strip().encode()
    matched = None
    for key in keys:
        if hmac.compare_digest(given, key.encode()) and matched is None:
            matched = key
    return None if matched is None else hashlib.sha256(matched.encode()).hexdigest()


def request_key_digest(request: web.Request, keys: tuple[str, ...]) -> str | None:
    """The digest of the API key ``request`` presents, when it is one of ``keys``: sent as
    ``Authorization: Bearer <key>`` or, as Anthropic's clients send it, ``x-api-key: <key>``."""
    header = request.headers.get("Authorization")
    if header is None and "x-api-key" in request.headers:
        header = "Bearer " + request.headers["x-api-key"]
    return matching_key_digest(header or "", keys)


def namespaced_salt(digest: str, salt: str | None) -> str:
    """The salt of a request under ``cache_isolation = "api-key"``: one namespace per key, and
    within it one per ``salt`` (fixed length whatever the salt's)."""
    return hashlib.sha256(f"{digest}\0{salt or ''}".encode()).hexdigest()


def isolate(request: web.Request, isolation: str, body: Any) -> Any:
    """``body`` (a decoded request with ``cache_salt``) with its salt in the key's namespace,
    and its ``user`` (the tenant the fair policy and the metrics count) the key's: a client
    neither speaks for another key's users nor gains a larger share by naming many."""
    if isolation == "api-key" and hasattr(body, "cache_salt"):
        digest = request.get(API_KEY_DIGEST)
        assert digest is not None, "cache isolation by API key runs behind the auth middleware"
        body.cache_salt = namespaced_salt(digest, body.cache_salt)
        if hasattr(body, "user"):
            body.user = key_tenant(digest)
    return body


def key_tenant(digest: str) -> str:
    """The tenant of an API key's requests under isolation by key (a prefix of its digest)."""
    return "key-" + digest[:12]


class _PublicMetrics:
    """A registry's families less the cache-revealing and tenant-labelled ones."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if cache_revealing(family.name):
                continue
            if any("tenant" in sample.labels for sample in family.samples):
                continue
            yield family


def public_exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(_PublicMetrics(registry))  # type: ignore[arg-type]
