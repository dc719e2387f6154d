"""The prefix cache keys a sequence by its LoRA adapter: pages computed under one adapter match
no other adapter, no cache salt and not the base; KV events say which adapter stored them."""

from __future__ import annotations

from asyncengine.cache.kv_events import BlockStored
from asyncengine.cache.manager import KVCacheManager
from asyncengine.cache.radix_cache import HEAD_BUCKETS
from asyncengine.common.cache_salt import lora_id, lora_id_of_key, salt_token, salted_ids
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams

PROMPT = list(range(10, 38))  # 7 pages of 4


def _cache(kv: KVCacheManager, ids: list[int]) -> None:
    seq = kv.open(ids)
    kv.extend(seq, len(ids))
    seq.computed_len = len(ids)
    kv.close(seq, ids, cache=True)


def test_adapter_keys_differ_from_the_base_other_adapters_and_salts() -> None:
    keys = {
        "base": PROMPT,
        "a": salted_ids(PROMPT, None, "a"),
        "b": salted_ids(PROMPT, None, "b"),
        "salt a": salted_ids(PROMPT, "a"),
        "a + salt": salted_ids(PROMPT, "s", "a"),
        "a + other salt": salted_ids(PROMPT, ":s", "a"),
        "moved": salted_ids(PROMPT, "s", "a:"),
    }
    firsts = [k[0] for k in keys.values()]
    assert len(set(firsts)) == len(firsts)
    assert all(k[1:] == PROMPT[1:] for k in keys.values())
    assert lora_id_of_key(keys["a"][0]) == lora_id_of_key(keys["a + salt"][0]) == lora_id("a")
    assert lora_id_of_key(keys["b"][0]) == lora_id("b") != lora_id("a")
    assert lora_id_of_key(keys["salt a"][0]) is None and lora_id_of_key(PROMPT[0]) is None
    req = Request("r", PROMPT, SamplingParams(lora="a"), 0.0)
    assert req.lora == "a" and req.all_ids == PROMPT and req.cache_ids == keys["a"]
    assert req.cache_ids[0] == salt_token(None, "a", PROMPT[0]) < 0


def test_pages_of_one_adapter_match_nothing_else_and_events_carry_it() -> None:
    kv = KVCacheManager(num_pages=64, page_size=4, max_rows=4, max_pages_per_row=16, kv_events=True)
    under_a = salted_ids(PROMPT, None, "a")
    _cache(kv, under_a)
    assert kv.match_length(under_a) >= len(PROMPT) - 4
    for other in (PROMPT, salted_ids(PROMPT, None, "b"), salted_ids(PROMPT, "a")):
        assert kv.match_length(other) == 0
    _cache(kv, PROMPT)
    _cache(kv, salted_ids(PROMPT, "tenant"))
    _cache(kv, under_a[:12] + [99] * 8)  # a branch below the adapter's pages
    kv.check_invariant()
    stored = [e for e in kv.tree.drain_events() if isinstance(e, BlockStored)]
    assert [e.lora_id for e in stored] == [lora_id("a"), None, None, lora_id("a")]


def test_insert_counters_stay_bounded_however_many_cache_salts_arrive() -> None:
    # every salt makes a first token of its own; a server that sees a new salt per user must
    # not keep a counter per salt for as long as it runs
    kv = KVCacheManager(num_pages=64, page_size=4, max_rows=4, max_pages_per_row=16)
    page = PROMPT[:4]
    for i in range(HEAD_BUCKETS + 2048):
        _cache(kv, salted_ids(page, f"user-{i}"))
    assert len(kv.tree.head_inserts) <= HEAD_BUCKETS
    # a salted prompt's epoch still moves when a prefix it could match is inserted
    salted = salted_ids(PROMPT, "fresh")
    before = kv.prefix_epoch(salted)
    _cache(kv, salted)
    assert kv.prefix_epoch(salted) != before
    assert kv.match_length(salted) >= len(PROMPT) - 4
