"""Cache salts: requests with different ``cache_salt`` share no prefix pages (vLLM's meaning),
nor do requests under different LoRA adapters (their KV differs from the base model's).

A salted request's tokens are keyed in the prefix cache with its first token replaced by a
negative id derived from the salt and the adapter: no real token is negative, so no other
salt's or adapter's (or an unsalted base) sequence shares even its first page, while every page
stays page aligned and the KV accounting is unchanged. The executor never sees these keys: it
computes on the real ids.
"""

from __future__ import annotations

import hashlib

# int64 packs of page hashes (cache/kv_events.py) must hold the key: 62 bits, negated
_SALT_BITS = 62


def salt_token(salt: str | None, lora: str | None = None) -> int:
    """The negative stand-in for the first token of every sequence salted with ``salt`` and
    run under adapter ``lora``. The adapter is hashed under its own personalisation, so no
    cache_salt string can name an adapter's key."""
    if lora is None:
        assert salt is not None
        digest = hashlib.blake2b(salt.encode(), digest_size=8, person=b"cache-salt").digest()
    else:
        # length-prefixed: (salt, lora) pairs cannot collide by moving characters across
        key = f"{len(lora)}:{lora}:{salt or ''}".encode()
        digest = hashlib.blake2b(key, digest_size=8, person=b"lora-salt").digest()
    return -1 - (int.from_bytes(digest, "little") >> (64 - _SALT_BITS))


def salted_ids(prompt_ids: list[int], salt: str | None, lora: str | None = None) -> list[int]:
    """``prompt_ids`` as the prefix cache keys them under ``salt`` and adapter ``lora``."""
    if not prompt_ids:
        return prompt_ids
    return [salt_token(salt, lora), *prompt_ids[1:]]
