"""Cache salts: requests with different ``cache_salt`` share no prefix pages (vLLM's meaning),
nor do requests under different LoRA adapters (their KV differs from the base model's).

A salted request's tokens are keyed in the prefix cache with its first token replaced by a
negative id derived from the salt, the adapter and that first token (two prompts of one salt
that differ only there must not share its KV): no real token is negative, so no other salt's or
adapter's (or an unsalted base) sequence shares even its first page, while every page stays page
aligned and the KV accounting is unchanged. The executor never sees these keys: it
computes on the real ids.

Under an adapter the key also says which one (``lora_id``, a 21-bit digest of its name), so the
radix tree can label the pages it reports to routers (cache/kv_events.py) without any table.
"""

from __future__ import annotations

import hashlib

# int64 packs of page hashes (cache/kv_events.py) must hold the key: 62 bits, negated. The top
# one marks a key made under an adapter; then 21 bits name the adapter and 40 bits the pair.
_SALT_BITS = 61
_LORA_FLAG = 1 << 61
_LORA_ID_BITS = 21
_PAIR_BITS = 40


def _digest(text: str, person: bytes, bits: int) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8, person=person).digest()
    return int.from_bytes(digest, "little") >> (64 - bits)


def lora_id(lora: str) -> int:
    """The adapter's id in KV events (BlockStored.lora_id): a digest of its name, > 0."""
    return 1 + _digest(lora, b"lora-id", _LORA_ID_BITS) % ((1 << _LORA_ID_BITS) - 1)


def salt_token(salt: str | None, lora: str | None, first: int) -> int:
    """The negative stand-in for the first token ``first`` of a sequence salted with ``salt``
    and run under adapter ``lora``."""
    if lora is None:
        assert salt is not None
        return -1 - _digest(f"{first}:{salt}", b"cache-salt", _SALT_BITS)
    # length-prefixed: (salt, lora) pairs cannot collide by moving characters across
    pair = _digest(f"{first}:{len(lora)}:{lora}:{salt or ''}", b"lora-salt", _PAIR_BITS)
    return -1 - (_LORA_FLAG | lora_id(lora) << _PAIR_BITS | pair)


def lora_id_of_key(first_token: int) -> int | None:
    """The adapter id a cached sequence's first key token was made under (None: the base)."""
    if first_token >= 0:
        return None
    value = -1 - first_token
    if not value & _LORA_FLAG:
        return None
    return (value >> _PAIR_BITS) & ((1 << _LORA_ID_BITS) - 1)


def salted_ids(prompt_ids: list[int], salt: str | None, lora: str | None = None) -> list[int]:
    """``prompt_ids`` as the prefix cache keys them under ``salt`` and adapter ``lora`` (the
    ids themselves under neither)."""
    if not prompt_ids or (salt is None and lora is None):
        return prompt_ids
    return [salt_token(salt, lora, prompt_ids[0]), *prompt_ids[1:]]
