"""Stateful property tests: RadixCache and KVCacheManager against a brute-force model.

The model stores the cache as a dict from every cached page-aligned prefix (a tuple of tokens)
to the page id of its last page, plus the access time of that prefix. Matching is a walk over
growing prefixes; eviction is checked for safety (only unlocked pages, prefix closed, enough
freed) and for LRU order (the least recently used unlocked leaf goes first).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from asyncengine.cache import KVCacheManager, OutOfPagesError, RadixCache, RadixNode, SeqKV
from asyncengine.policies.eviction_registry import EVICTION_RULES, make_eviction_rule

Prefix = tuple[int, ...]


class PrefixModel:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[Prefix, int] = {}
        self.times: dict[Prefix, int] = {}
        self.clock = 0

    def _prefixes(self, tokens: list[int]) -> list[Prefix]:
        ps = self.page_size
        return [tuple(tokens[:end]) for end in range(ps, len(tokens) // ps * ps + 1, ps)]

    def match(self, tokens: list[int], touch: bool = True) -> tuple[list[int], int]:
        found: list[int] = []
        matched: list[Prefix] = []
        for prefix in self._prefixes(tokens):
            if prefix not in self.pages:
                break
            found.append(self.pages[prefix])
            matched.append(prefix)
        if touch:
            self.clock += 1
            for prefix in matched:
                self.times[prefix] = self.clock
        return found, len(found) * self.page_size

    def insert(self, tokens: list[int], page_ids: list[int]) -> int:
        self.clock += 1
        present: int | None = None
        for index, prefix in enumerate(self._prefixes(tokens)):
            if prefix not in self.pages:
                if present is None:
                    present = index * self.page_size
                self.pages[prefix] = page_ids[index]
            self.times[prefix] = self.clock
        return len(tokens) // self.page_size * self.page_size if present is None else present

    def leaves(self) -> set[Prefix]:
        parents = {prefix[: -self.page_size] for prefix in self.pages}
        return set(self.pages) - parents

    def apply_eviction(
        self, remaining: dict[Prefix, int], locked: set[Prefix], asked: int, lru: bool = True
    ) -> int:
        """Check an eviction that left ``remaining`` and adopt it; returns tokens freed
        (``lru``: and that the least recently used leaf went first)."""
        ps = self.page_size
        removed = set(self.pages) - set(remaining)
        for prefix, page in remaining.items():
            assert self.pages.get(prefix) == page, f"eviction changed or added {prefix}"
            if len(prefix) > ps:
                assert prefix[:-ps] in remaining, f"eviction left an orphan {prefix}"
        assert not removed & locked, f"evicted locked prefixes {sorted(removed & locked)[:3]}"
        evictable = len(set(self.pages) - locked) * ps
        freed = len(removed) * ps
        assert freed >= min(asked, evictable), (
            f"asked {asked}, evictable {evictable}, freed {freed}"
        )
        candidates = [leaf for leaf in self.leaves() if leaf not in locked]
        if lru and asked > 0 and candidates:
            oldest = min(candidates, key=lambda prefix: self.times[prefix])
            assert oldest in removed, f"least recently used leaf {oldest} survived eviction"
        for prefix in removed:
            del self.pages[prefix]
            del self.times[prefix]
        return freed


def tree_contents(tree: RadixCache) -> dict[Prefix, int]:
    contents: dict[Prefix, int] = {}
    stack: list[tuple[RadixNode, Prefix]] = [(tree.root, ())]
    ps = tree.page_size
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            child_path = path + child.key
            for index, page in enumerate(child.value.tolist()):
                contents[tuple(child_path[: len(path) + (index + 1) * ps])] = page
            stack.append((child, child_path))
    return contents


def locked_prefixes(model: PrefixModel, locked_paths: list[list[int]]) -> set[Prefix]:
    locked: set[Prefix] = set()
    for tokens in locked_paths:
        locked.update(model._prefixes(tokens))
    return locked


class SequencePool:
    """Token sequences built from earlier ones, so that they share prefixes."""

    def __init__(self, max_len: int, max_pool: int = 24) -> None:
        self.max_len = max_len
        self.max_pool = max_pool
        self.sequences: list[list[int]] = [[]]

    def draw(self, data: st.DataObject, max_len: int | None = None) -> list[int]:
        limit = self.max_len if max_len is None else max_len
        base = data.draw(st.sampled_from(self.sequences), label="base")
        cut = data.draw(st.integers(0, min(len(base), limit)), label="cut")
        tail = data.draw(st.lists(st.integers(0, 2), max_size=limit - cut), label="tail")
        tokens = base[:cut] + tail
        if len(self.sequences) < self.max_pool:
            self.sequences.append(tokens)
        return tokens


# --------------------------------------------------------------------------- RadixCache alone


def lowest_key_leaves(tree: RadixCache) -> tuple[float, list[RadixNode]]:
    """The unlocked leaves the tree's eviction rule ranks lowest, and their key."""
    leaves = [node for node in tree.iter_nodes() if not node.children and node.lock_ref == 0]
    if not leaves:
        return 0.0, []
    keys = [tree.rule.key(node) for node in leaves]
    low = min(keys)
    return low, [node for node, key in zip(leaves, keys, strict=True) if key == low]


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    max_len = 40
    rule_name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixCache(self.page_size, rule=make_eviction_rule(self.rule_name))
        self.model = PrefixModel(self.page_size)
        self.pool = SequencePool(self.max_len)
        self.next_page = 0
        self.locks: list[tuple[RadixNode, list[int]]] = []

    def fresh_pages(self, tokens: list[int]) -> np.ndarray:
        count = len(tokens) // self.page_size
        ids = np.arange(self.next_page, self.next_page + count, dtype=np.int32)
        self.next_page += count
        return ids

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        tokens = self.pool.draw(data)
        ids = self.fresh_pages(tokens)
        assert self.tree.insert(tokens, ids) == self.model.insert(tokens, ids.tolist())

    @rule(data=st.data(), lock=st.booleans())
    def match(self, data: st.DataObject, lock: bool) -> None:
        tokens = self.pool.draw(data)
        expected_pages, expected_len = self.model.match(tokens, touch=False)
        assert self.tree.prefix_length(tokens) == expected_len
        found, matched, node = self.tree.match_prefix(tokens)
        assert self.model.match(tokens) == (found.tolist(), matched)
        assert node.prefix_len == matched
        if lock:
            self.tree.lock(node)
            self.locks.append((node, tokens[:matched]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.locks) - 1), label="lock")
        node, _ = self.locks.pop(index)
        self.tree.unlock(node)

    @rule(data=st.data())
    def watch_waiting(self, data: st.DataObject) -> None:
        prompts = [self.pool.draw(data) for _ in range(data.draw(st.integers(0, 3)))]
        self.tree.rule.watch_waiting(prompts)

    @rule(num_tokens=st.integers(0, 60))
    def evict(self, num_tokens: int) -> None:
        locked = locked_prefixes(self.model, [path for _, path in self.locks])
        _, first = lowest_key_leaves(self.tree)
        freed = self.tree.evict(num_tokens)
        if num_tokens > 0 and first:  # the rule's lowest key went first, whatever the rule
            assert any(node.parent is None for node in first), "the lowest key survived"
        remaining = tree_contents(self.tree)
        count = self.model.apply_eviction(remaining, locked, num_tokens, self.rule_name == "lru")
        assert freed.size * self.page_size == count

    @invariant()
    def tree_matches_model(self) -> None:
        self.tree.check()
        assert tree_contents(self.tree) == self.model.pages
        locked = locked_prefixes(self.model, [path for _, path in self.locks])
        ps = self.page_size
        assert self.tree.protected_size == len(locked) * ps
        assert self.tree.evictable_size == (len(self.model.pages) - len(locked)) * ps
        for node, path in self.locks:
            assert node.prefix_len == len(path)  # a lock's node survives splits


class RadixMachinePage16(RadixMachine):
    page_size = 16
    max_len = 110


RADIX_SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestRadixPage1 = RadixMachine.TestCase
TestRadixPage1.settings = RADIX_SETTINGS
TestRadixPage16 = RadixMachinePage16.TestCase
TestRadixPage16.settings = RADIX_SETTINGS


def _rule_machine(base: type[RadixMachine], name: str) -> type:
    machine = type(f"{base.__name__}_{name}", (base,), {"rule_name": name})
    case = machine.TestCase
    case.settings = RADIX_SETTINGS
    return case


# rules of one's own, checked as the built-ins are (docs/policies.md, "Eviction policies")
OWN_RULES_VARIABLE = "ASYNCENGINE_CHECK_EVICTION"


def rules_to_check(environ: Mapping[str, str]) -> dict[str, str]:
    """Test-class suffix -> rule spec: every built-in past lru (which the base classes check),
    then each comma-separated spec of ``OWN_RULES_VARIABLE`` as ``own_1``, ``own_2``, ..."""
    rules = {name.replace("-", "_"): name for name in EVICTION_RULES if name != "lru"}
    own = [spec.strip() for spec in environ.get(OWN_RULES_VARIABLE, "").split(",")]
    for index, spec in enumerate([spec for spec in own if spec], 1):
        rules[f"own_{index}"] = spec
    return rules


RULES_TO_CHECK = rules_to_check(os.environ)
# every eviction rule: the same tree contents, locks and sizes; its own lowest key goes first
for _ident, _name in RULES_TO_CHECK.items():
    globals()[f"TestRadixPage1_{_ident}"] = _rule_machine(RadixMachine, _name)
    globals()[f"TestRadixPage16_{_ident}"] = _rule_machine(RadixMachinePage16, _name)


# --------------------------------------------------------------------------- KVCacheManager


@dataclass(slots=True)
class LiveSeq:
    seq: SeqKV
    tokens: list[int]


class ManagerMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 96
    max_pages_per_row = 48
    max_rows = 4
    rule_name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(
            num_pages=self.num_pages,
            page_size=self.page_size,
            max_rows=self.max_rows,
            max_pages_per_row=self.max_pages_per_row,
            eviction_rule=make_eviction_rule(self.rule_name),
        )
        self.model = PrefixModel(self.page_size)
        self.max_tokens = self.max_pages_per_row * self.page_size
        self.pool = SequencePool(self.max_tokens - 8)
        self.live: dict[int, LiveSeq] = {}
        self.counters = (0, 0)  # hit and miss tokens at the last check

    @initialize()
    def start_empty(self) -> None:
        self.mgr.check_invariant()

    def locked(self) -> set[Prefix]:
        return locked_prefixes(
            self.model, [live.tokens[: live.seq.num_in_tree] for live in self.live.values()]
        )

    def pick(self, data: st.DataObject) -> LiveSeq:
        row = data.draw(st.sampled_from(sorted(self.live)), label="row")
        return self.live[row]

    def model_cache(self, live: LiveSeq) -> None:
        """Mirror KVCacheManager.cache in the model, before the manager runs it."""
        seq = live.seq
        aligned = seq.kv_len // self.page_size * self.page_size
        if aligned > seq.num_in_tree:
            prefix = live.tokens[:aligned]
            own = seq.pages[: aligned // self.page_size]
            self.model.insert(prefix, own)
            self.model.match(prefix)

    @precondition(lambda self: len(self.live) < self.max_rows)
    @rule(data=st.data())
    def open(self, data: st.DataObject) -> None:
        tokens = self.pool.draw(data)
        limit = max(0, (len(tokens) - 1) // self.page_size * self.page_size)
        expected_pages, expected_len = self.model.match(tokens[:limit], touch=False)
        assert self.mgr.match_length(tokens) == expected_len
        matched, room = self.mgr.match_room(tokens)
        before = self.mgr.stats()
        seq = self.mgr.open(tokens)
        # the room told before the open is what extend can give the sequence after it
        assert (matched, room) == (expected_len, self.mgr.available_pages)
        if limit:
            self.model.match(tokens[:limit])
        assert (seq.kv_len, seq.num_cached, seq.num_in_tree) == (expected_len,) * 3
        assert seq.pages == expected_pages
        opened = self.mgr.stats()
        assert (opened["hit_tokens"], opened["miss_tokens"]) == (
            before["hit_tokens"],
            before["miss_tokens"],
        ), "open counted a prompt that is not admitted yet"
        self.mgr.count_admitted(seq, len(tokens))
        after = self.mgr.stats()
        assert after["hit_tokens"] == before["hit_tokens"] + expected_len
        assert after["miss_tokens"] == before["miss_tokens"] + len(tokens) - expected_len
        self.live[seq.row] = LiveSeq(seq, list(tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        live = self.pick(data)
        seq = live.seq
        room = self.max_tokens - seq.kv_len
        num_tokens = data.draw(st.integers(0, min(room, 3 * self.page_size + 2)), label="n")
        missing = seq.kv_len + num_tokens - len(live.tokens)
        if missing > 0:  # decode: the sequence grows by sampled tokens
            live.tokens += data.draw(
                st.lists(st.integers(0, 2), min_size=missing, max_size=missing)
            )
        fits = self.mgr.pages_needed(seq, num_tokens) <= self.mgr.available_pages
        shortfall = self.mgr.pages_needed(seq, num_tokens) - self.mgr.allocator.num_free
        shortfall -= len(self.mgr.tails)  # kept tail pages go back before tree pages
        before = (self.mgr.stats(), self.mgr.tree.dump(), seq.kv_len, list(seq.pages))
        locked = self.locked()
        try:
            self.mgr.extend(seq, num_tokens)
        except OutOfPagesError:
            assert not fits
            after = (self.mgr.stats(), self.mgr.tree.dump(), seq.kv_len, list(seq.pages))
            assert after == before, "a failed extend changed the state"
            return
        assert fits
        assert seq.kv_len == before[2] + num_tokens
        assert seq.pages[: len(before[3])] == before[3]
        # Evicts only when the free list is short, and then the LRU leaves first.
        asked = max(0, shortfall) * self.page_size
        freed = self.model.apply_eviction(
            tree_contents(self.mgr.tree), locked, asked, self.rule_name == "lru"
        )
        assert freed == 0 or shortfall > 0, "extend evicted with enough free pages"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        live = self.pick(data)
        in_tree_before = live.seq.num_in_tree
        self.model_cache(live)
        self.mgr.cache(live.seq, live.tokens)
        aligned = live.seq.kv_len // self.page_size * self.page_size
        assert live.seq.num_in_tree == max(aligned, in_tree_before)
        expected, _ = self.model.match(live.tokens[:aligned], touch=False)
        assert live.seq.pages[: aligned // self.page_size] == expected

    @precondition(lambda self: self.live)
    @rule(data=st.data(), cache=st.booleans())
    def close(self, data: st.DataObject, cache: bool) -> None:
        live = self.pick(data)
        if cache:
            self.model_cache(live)
        self.mgr.close(live.seq, live.tokens, cache=cache)
        del self.live[live.seq.row]

    @precondition(lambda self: len(self.live) < self.max_rows and len(self.mgr.tails) > 0)
    @rule(data=st.data())
    def open_after_a_tail(self, data: st.DataObject) -> None:
        """Open a sequence going on from a kept tail page (some of its tokens, then others)
        and copy their KV from it (copy on write into a page of its own; the tail page is
        never written)."""
        entries = sorted(self.mgr.tails._entries.values(), key=lambda e: (e.prefix, e.tokens))
        entry = data.draw(st.sampled_from(entries), label="tail")
        shared = data.draw(st.integers(1, len(entry.tokens)), label="shared")
        extra = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=4), label="extra")
        tokens = [*entry.prefix, *entry.tokens[:shared], *extra]
        if len(tokens) > self.max_tokens:
            return
        limit = max(0, (len(tokens) - 1) // self.page_size * self.page_size)
        expected_pages, expected_len = self.model.match(tokens[:limit], touch=False)
        seq = self.mgr.open(tokens)
        if limit:
            self.model.match(tokens[:limit])
        assert (seq.kv_len, seq.pages) == (expected_len, expected_pages)
        self.live[seq.row] = LiveSeq(seq, tokens)
        found = self.mgr.find_tail(seq, tokens)
        assert found is not None and len(found[0].prefix) == seq.kv_len
        assert found[1] >= (shared if len(entry.prefix) == seq.kv_len else 1)
        found_entry, common = found
        assert tokens[seq.kv_len : seq.kv_len + common] == list(found_entry.tokens[:common])
        num_tokens = data.draw(st.integers(1, min(common, len(tokens) - 1 - seq.kv_len)))
        before = (seq.kv_len, list(seq.pages), self.mgr.stats()["hit_tokens"])
        tail_hits = self.mgr.tails.hit_tokens
        free, locked = self.mgr.allocator.num_free, self.locked()
        self.mgr.drain_page_copies()
        assert self.mgr.take_tail(seq, found_entry, num_tokens)  # a tail is there to give back
        assert seq.kv_len == seq.computed_len == before[0] + num_tokens
        assert seq.pages[:-1] == before[1]
        copies = self.mgr.drain_page_copies()
        assert copies == [(found_entry.page, seq.pages[-1])]
        assert seq.pages[-1] not in self.mgr.tails.pages()
        assert self.mgr.stats()["hit_tokens"] == before[2]  # counted once admitted
        self.mgr.count_admitted(seq, len(tokens))
        assert self.mgr.stats()["hit_tokens"] == before[2] + before[0] + num_tokens
        assert self.mgr.tails.hit_tokens == tail_hits + num_tokens
        self.model.apply_eviction(tree_contents(self.mgr.tree), locked, 0)
        assert free > 0 or len(self.mgr.tails) < len(entries)  # a tail went, not a tree page

    @rule(num_pages=st.integers(0, 12))
    def evict(self, num_pages: int) -> None:
        locked = self.locked()
        tails = min(num_pages, len(self.mgr.tails))  # kept tails go first
        freed = self.mgr.evict(num_pages)
        asked = (num_pages - tails) * self.page_size
        count = self.model.apply_eviction(
            tree_contents(self.mgr.tree), locked, asked, self.rule_name == "lru"
        )
        assert (freed - tails) * self.page_size == count

    @rule(data=st.data())
    def match_length(self, data: st.DataObject) -> None:
        tokens = self.pool.draw(data)
        limit = max(0, (len(tokens) - 1) // self.page_size * self.page_size)
        assert self.mgr.match_length(tokens) == self.model.match(tokens[:limit], touch=False)[1]

    @invariant()
    def accounting_holds(self) -> None:
        self.mgr.check_invariant()
        assert tree_contents(self.mgr.tree) == self.model.pages
        stats = self.mgr.stats()
        assert stats["pages_cached"] == len(self.model.pages)
        assert stats["pages_evictable"] == len(self.model.pages) - len(self.locked())
        assert self.mgr.num_open == len(self.live)
        counters = (stats["hit_tokens"], stats["miss_tokens"])
        # counted once at admission: neither hits nor all tokens go back
        assert counters[0] >= self.counters[0] and sum(counters) >= sum(self.counters), (
            f"hit/miss counters went back from {self.counters} to {counters}"
        )
        self.counters = counters


class ManagerMachinePage16(ManagerMachine):
    page_size = 16
    num_pages = 20
    max_pages_per_row = 8


MANAGER_SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestManagerPage1 = ManagerMachine.TestCase
TestManagerPage1.settings = MANAGER_SETTINGS
TestManagerPage16 = ManagerMachinePage16.TestCase
TestManagerPage16.settings = MANAGER_SETTINGS


def _manager_machine(name: str) -> type:
    machine = type(f"ManagerMachinePage16_{name}", (ManagerMachinePage16,), {"rule_name": name})
    case = machine.TestCase
    case.settings = MANAGER_SETTINGS
    return case


# every eviction rule keeps the page accounting invariant after every step
for _ident, _name in RULES_TO_CHECK.items():
    globals()[f"TestManagerPage16_{_ident}"] = _manager_machine(_name)
