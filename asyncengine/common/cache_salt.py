"""Cache salts: requests with different ``cache_salt`` share no prefix pages (vLLM's meaning).

A salted request's tokens are keyed in the prefix cache with its first token replaced by a
negative id derived from the salt: no real token is negative, so no other salt's (or an
unsalted) sequence shares even its first page, while every page stays page aligned and the
KV accounting is unchanged. The executor never sees these keys: it computes on the real ids.
"""

from __future__ import annotations

import hashlib

# int64 packs of page hashes (cache/kv_events.py) must hold the key: 62 bits, negated
_SALT_BITS = 62


def salt_token(salt: str) -> int:
    """The negative stand-in for the first token of every sequence salted with ``salt``."""
    digest = hashlib.blake2b(salt.encode(), digest_size=8, person=b"cache-salt").digest()
    return -1 - (int.from_bytes(digest, "little") >> (64 - _SALT_BITS))


def salted_ids(prompt_ids: list[int], salt: str) -> list[int]:
    """``prompt_ids`` as the prefix cache keys them under ``salt``."""
    if not prompt_ids:
        return prompt_ids
    return [salt_token(salt), *prompt_ids[1:]]
