"""KVCacheManager: the one owner of KV page accounting.

Invariant (``check_invariant``): every page is exactly one of
- free (in the allocator),
- held by a live sequence and not in the tree (its private pages), or
- owned by the radix tree (protected while some live sequence locks it, evictable otherwise), or
- the partly filled last page of an ended sequence, kept for reuse (tail_pages.py; given back
  before tree pages are evicted).

A live sequence's pages are ``seq.pages``: the first ``seq.num_in_tree // page_size`` of them are
the tree's pages along the path to ``seq.lock_node`` (which the sequence locks), the rest are its
own. The sequence's page-table row always mirrors ``seq.pages``; the table records its writes,
which the scheduler hands to the executor inside the next plan (see page_table.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from asyncengine.cache.allocator import OutOfPagesError, PageAllocator
from asyncengine.cache.eviction_ledger import EvictionLedger
from asyncengine.cache.eviction_rule import EvictionRule
from asyncengine.cache.host_tier import HostTier
from asyncengine.cache.page_table import OutOfRowsError, PageTable
from asyncengine.cache.pins import Pin, PinLimitError, PinnedPrefixes
from asyncengine.cache.radix_cache import PrefixEnd, RadixCache, RadixNode
from asyncengine.cache.swap_space import SwappedKV, SwapSpace
from asyncengine.cache.tail_pages import TailPage, TailPages
from asyncengine.common.plan import TokenLogprobs

Tokens = Sequence[int] | np.ndarray


@dataclass(slots=True, eq=False)
class SeqKV:
    """KV state of one live sequence."""

    row: int  # page-table row
    kv_len: int  # tokens with KV slots allocated (positions 0 .. kv_len - 1)
    num_cached: int  # tokens whose KV the caches give (matched at open, a kept tail, copies)
    pages: list[int]  # page ids covering positions 0 .. kv_len - 1
    lock_node: RadixNode  # the tree node this sequence locks
    num_in_tree: int  # leading tokens whose pages the tree owns (a multiple of page_size)
    # tokens whose KV is written: kv_len less the slots planned for a step not yet landed
    computed_len: int = 0
    tail_tokens: int = 0  # of num_cached, those a kept tail page gives (take_tail)


class KVCacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_rows: int,
        max_pages_per_row: int,
        enable_prefix_cache: bool = True,
        kv_events: bool = False,
        swap: SwapSpace | None = None,
        max_tail_pages: int | None = None,
        eviction_rule: EvictionRule | None = None,
        max_pinned_fraction: float = 0.25,
        host_tier: bool = False,
    ) -> None:
        """``kv_events``: the tree records what it stores and removes (cache/kv_events.py).
        ``max_tail_pages``: partly filled pages of ended sequences kept for reuse (default a
        quarter of the pool, at most 1024; tail_pages.py). ``eviction_rule``: which cached
        page goes first when the pool runs short (cache/eviction_rule.py; default LRU).
        ``max_pinned_fraction``: the share of the pool pinned prefixes may hold (pins.py).
        ``host_tier``: evicted pages go to the swap space's host buffer and come back on a hit
        (host_tier.py; needs ``swap``)."""
        self.num_pages = num_pages
        self.swap = swap  # the host buffer preempted requests' KV is swapped to, if any
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.allocator = PageAllocator(num_pages)
        self.tree = RadixCache(page_size, events=kv_events, rule=eviction_rule)
        self.ledger = EvictionLedger(page_size)
        self.tree.ledger = self.ledger
        self.page_table = PageTable(max_rows, max_pages_per_row, record_writes=True)
        self._open: dict[int, SeqKV] = {}  # row -> live sequence
        if max_tail_pages is None:
            max_tail_pages = min(1024, num_pages // 4)
        self.tails = TailPages(max_tail_pages if enable_prefix_cache else 0)
        # (source page, destination page): tail pages copied before the next plan's forward
        self._page_copies: list[tuple[int, int]] = []
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.in_step_shared_tokens = 0  # positions copied from a prompt of the same step
        self.pins = PinnedPrefixes(int(num_pages * max_pinned_fraction))
        self.host_tier: HostTier | None = None
        if host_tier:
            if swap is None:
                raise ValueError("the host tier needs a swap space (its host buffer)")
            self.host_tier = HostTier(swap, self.tree)
            self.tree.spill = self.host_tier
        self.host_hit_tokens = 0  # hit tokens copied back from the host tier
        # tree pages copied back from the host tier that no admitted prompt has counted yet: an
        # admission that fails after the copy counts them when it (or another prompt) gets in
        self._host_pages: set[int] = set()
        # eviction figures by rule: the rules swapped out, and the live one's since it began
        self.eviction_by_rule: dict[str, dict[str, int]] = {}
        self._rule_began = self._eviction_counts()

    # ----------------------------------------------------------------------------- queries

    @property
    def max_pages_per_row(self) -> int:
        return self.page_table.max_pages_per_row

    @property
    def max_tokens_per_request(self) -> int:
        return self.page_table.max_pages_per_row * self.page_size

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get now: free plus evictable from the tree."""
        return (
            self.allocator.num_free + self.tree.evictable_size // self.page_size + len(self.tails)
        )

    @property
    def num_open(self) -> int:
        return len(self._open)

    @property
    def num_free_rows(self) -> int:
        return self.page_table.num_free_rows

    def open_seqs(self) -> list[SeqKV]:
        return list(self._open.values())

    def _match_limit(self, num_tokens: int, limit: int | None = None) -> int:
        """Most tokens open() may take from the cache: at least one token is left to compute,
        and at most ``limit`` (a request scoring its prompt: prompt_scoring.py)."""
        if num_tokens <= 1:
            return 0
        most = num_tokens - 1 if limit is None else min(num_tokens - 1, limit)
        return most // self.page_size * self.page_size

    def match_length(self, tokens: Tokens, limit: int | None = None) -> int:
        """Tokens that open(tokens, limit) would take from the cache now; no side effects."""
        return self.match_length_again(tokens, limit, None)[0]

    def match_length_again(
        self, tokens: Tokens, limit: int | None, last: PrefixEnd | None
    ) -> tuple[int, PrefixEnd | None]:
        """``match_length``, and where the match ended (None: the cache is not asked): handed
        back as ``last`` when asking about the same tokens and limit again, it spares walking
        the tree while the tree under them is unchanged (RadixCache.prefix_end)."""
        if not self.enable_prefix_cache:
            return 0, None
        limit = self._match_limit(len(tokens), limit)
        if limit == 0:
            return 0, None
        found = self.tree.prefix_end(tokens, limit, last)  # tokens[:limit], without the copy
        return found.matched, found

    def match_room(self, tokens: Tokens, limit: int | None = None) -> tuple[int, int]:
        """``match_length(tokens, limit)`` and the pages ``extend`` can then give the sequence
        that ``open(tokens, limit)`` starts: ``available_pages`` less the matched pages that
        are evictable now (the open locks them). No side effects.

        The pages a kept tail or the host tier give an open each hold KV it would otherwise
        compute, so they take no more of that room than computing it would, except where a
        prompt is computed in chunks: there the host tier's pages and a kept tail's page may
        take more than the first chunk alone."""
        matched, room, _ = self.match_room_again(tokens, limit, None)
        return matched, room

    def match_room_again(
        self, tokens: Tokens, limit: int | None, last: PrefixEnd | None
    ) -> tuple[int, int, PrefixEnd | None]:
        """``match_room``, and where the match ended, as ``match_length_again``."""
        matched, found = self.match_length_again(tokens, limit, last)
        if found is None:
            return 0, self.available_pages, None
        unlocked = self.tree.unlocked_in(found)
        return matched, self.available_pages - unlocked // self.page_size, found

    def prefix_epoch(self, tokens: Tokens) -> int:
        """Changes whenever ``match_length(tokens)`` may have grown: the inserts into the tree
        that start with ``tokens``' first token (RadixCache.head_inserts)."""
        return self.tree.head_epoch(int(tokens[0])) if len(tokens) else 0

    def cache_epoch(self) -> int:
        """Changes whenever any ``match_length`` may have grown: every insert into the tree."""
        return self.tree.inserts

    def own_pages(self, seq: SeqKV) -> int:
        """Pages ``seq`` holds that are not the tree's (what closing it frees at once)."""
        return len(seq.pages) - seq.num_in_tree // self.page_size

    def reservation_pages(self, tokens: float) -> int:
        """Pages kept free for ``tokens`` future tokens (already scaled by new_token_ratio)."""
        return math.ceil(tokens / self.page_size)

    def _load_from_host(
        self,
        tokens: Tokens,
        matched_pages: np.ndarray | None,
        matched: int,
        node: RadixNode,
        most: int,
    ) -> tuple[np.ndarray | None, int, RadixNode]:
        """Go on past the tree's match with the pages the host tier holds: fresh pool pages,
        the copies back recorded for the next plan, the pages into the tree; the sequence then
        locks the new end (``node`` is locked on entry, the returned node on exit)."""
        tier = self.host_tier
        assert tier is not None
        host = tier.lookup(tokens, matched, most)
        if not host:
            return matched_pages, matched, node
        short = len(host) - self.allocator.num_free
        if short > 0:
            self._reclaim(short)
            # the leaves evicted for room spill into the tier, which may drop the pages found
            host = tier.lookup(tokens, matched, most)
        host = host[: self.allocator.num_free]
        if not host:
            return matched_pages, matched, node
        pool = self.allocator.alloc_ids(len(host))
        tier.load(host, pool)
        end = matched + len(host) * self.page_size
        before = [] if matched_pages is None else matched_pages.tolist()
        present, new_node = self.tree.insert_at(tokens[:end], before + pool, node)
        assert present == matched, f"the tree held {present} tokens, matched {matched}"
        self.tree.lock(new_node)
        self.tree.unlock(node)
        self._host_pages.update(pool)
        return np.asarray(before + pool, dtype=np.int32), end, new_node

    def pages_needed(self, seq: SeqKV | None, num_tokens: int) -> int:
        """New pages extend(seq, num_tokens) would allocate (seq None: a fresh sequence).

        extend() succeeds when this is at most ``available_pages``. open() locks the matched
        prefix, which takes it out of the evictable pages: before the open, ``match_room`` says
        what is left for the sequence."""
        if seq is None:
            return -(-num_tokens // self.page_size)
        return max(0, -(-(seq.kv_len + num_tokens) // self.page_size) - len(seq.pages))

    # ----------------------------------------------------------------------------- life cycle

    def open(self, tokens: Tokens, limit: int | None = None) -> SeqKV:
        """Start a sequence: match its cached prefix (page aligned, at most len - 1 tokens and
        at most ``limit``), lock it, take a page-table row and write the matched pages into it.
        The hit counters wait for ``count_admitted``: an open whose admission fails is closed and
        opened again later, and a retracted request opens again, each counted once."""
        if len(tokens) > self.max_tokens_per_request:
            raise ValueError(
                f"sequence of {len(tokens)} tokens exceeds {self.max_tokens_per_request} "
                f"tokens per request"
            )
        if self.page_table.num_free_rows == 0:
            raise OutOfRowsError(
                f"all {self.page_table.max_rows} page-table rows are held by open sequences"
            )
        matched_pages: np.ndarray | None = None
        matched = 0
        node = self.tree.root
        most = self._match_limit(len(tokens), limit) if self.enable_prefix_cache else 0
        if most > 0:
            matched_pages, matched, node = self.tree.match_prefix(tokens, most)
        self.tree.lock(node)
        if self.host_tier is not None and most - matched >= self.page_size:
            matched_pages, matched, node = self._load_from_host(
                tokens, matched_pages, matched, node, most
            )
        row = self.page_table.acquire()
        pages: list[int] = []
        if matched_pages is not None and matched:
            self.page_table.set_pages(row, 0, matched_pages)
            pages = matched_pages.tolist()
        seq = SeqKV(
            row=row,
            kv_len=matched,
            num_cached=matched,
            pages=pages,
            lock_node=node,
            num_in_tree=matched,
            computed_len=matched,
        )
        self._open[row] = seq
        return seq

    def extend(self, seq: SeqKV, num_tokens: int) -> None:
        """Give ``seq`` KV slots for positions kv_len .. kv_len + num_tokens - 1, evicting LRU
        tree leaves when the free list is short. On failure raises OutOfPagesError and changes
        nothing."""
        new_len = seq.kv_len + num_tokens
        if 0 <= num_tokens and new_len <= len(seq.pages) * self.page_size and seq.row in self._open:
            seq.kv_len = new_len  # fast path: the tokens fit in the pages the sequence has
            return
        self._check_open(seq)
        if num_tokens < 0:
            raise ValueError(f"cannot extend by a negative number of tokens ({num_tokens})")
        total_pages = -(-new_len // self.page_size)
        if total_pages > self.max_pages_per_row:
            raise ValueError(
                f"extending to {new_len} tokens exceeds {self.max_tokens_per_request} "
                f"tokens per request"
            )
        needed = total_pages - len(seq.pages)
        if needed > 0:
            free = self.allocator.num_free
            if needed > free:
                if needed > self.available_pages:
                    raise OutOfPagesError(
                        f"asked for {needed} KV pages but only {free} are free and "
                        f"{self.tree.evictable_size // self.page_size} evictable "
                        f"(of {self.num_pages})"
                    )
                self._reclaim(needed - free)
            new_pages = self.allocator.alloc_ids(needed)
            self.page_table.set_pages(seq.row, len(seq.pages), new_pages)
            seq.pages.extend(new_pages)
        seq.kv_len = new_len

    def extend_each_by_one(self, seqs: list[SeqKV]) -> None:
        """``extend(seq, 1)`` for each of ``seqs`` in order, for sequences whose pages are all
        full (each takes one new page): the same pages, evictions and table writes as one by
        one, allocated in runs from the free list."""
        ps, most = self.page_size, self.page_table.max_pages_per_row
        allocator, tails = self.allocator, self.tails
        n = len(seqs)
        each_full = n <= allocator.num_free + self.tree.evictable_size // ps + len(tails)
        opened = self._open
        all_open = True
        for seq in seqs:
            if not each_full:
                break
            held = len(seq.pages)
            each_full = seq.kv_len == held * ps and held < most
            all_open = all_open and opened.get(seq.row) is seq
        if not each_full:
            for seq in seqs:
                self.extend(seq, 1)
            return
        if not all_open:
            for seq in seqs:
                if opened.get(seq.row) is not seq:
                    self._check_open(seq)  # raises
        table = self.page_table
        store = table.stores_pages  # else rows only: no write to record (none can fail here)
        rows: list[int] = []
        indexes: list[int] = []
        taken: list[int] = []
        while len(taken) < n:
            free = allocator.num_free
            if free == 0:
                if tails:
                    # one at a time, extend would give back one kept tail and take its page
                    # for the next sequence, tail after tail: the same pages, in that order
                    popped = [tails.pop_lru() for _ in range(min(len(tails), n - len(taken)))]
                    popped.reverse()  # the free list is a stack: the first popped on top
                    self._give_back(popped)
                elif self._reclaim(1) == 0:
                    if store:
                        table.set_each(rows, indexes, taken)
                    raise OutOfPagesError("no KV page is free or evictable")
                continue
            pages = allocator.alloc_ids(min(free, n - len(taken)))
            given = seqs[len(taken) : len(taken) + len(pages)]
            if store:
                for seq in given:
                    rows.append(seq.row)
                    indexes.append(len(seq.pages))
            for seq, page in zip(given, pages, strict=True):
                seq.pages.append(page)
                seq.kv_len += 1
            taken += pages
        if store:
            table.set_each(rows, indexes, taken)

    def truncate(self, seq: SeqKV, length: int) -> None:
        """Give back the slots of positions ``length .. kv_len - 1`` (a verified row's rejected
        guesses): ``kv_len`` becomes ``length`` and the pages past it return to the free list.
        Only the sequence's own pages can go: ``length`` may not cut into its cached prefix."""
        self._check_open(seq)
        if not seq.num_in_tree <= length <= seq.kv_len:
            raise ValueError(
                f"cannot truncate to {length} tokens (cached prefix {seq.num_in_tree}, "
                f"kv_len {seq.kv_len})"
            )
        keep = -(-length // self.page_size)
        if keep < len(seq.pages):
            self.allocator.free_ids(seq.pages[keep:])
            del seq.pages[keep:]
        seq.kv_len = length
        seq.computed_len = min(seq.computed_len, length)

    def cache(self, seq: SeqKV, tokens: Tokens) -> None:
        """Insert the whole pages of ``tokens[:seq.kv_len]`` into the tree.

        Where the tree already held some of those tokens under other pages, the sequence's
        duplicates are freed and it (and its table row) points at the tree's pages. The lock
        moves to the node ending at the inserted prefix."""
        self._cache(seq, tokens)

    def _cache(self, seq: SeqKV, tokens: Tokens) -> tuple[int, ...] | None:
        """``cache``; the inserted prefix when it was made a tuple (``close`` keys the tail
        page by the same tokens), else None."""
        self._check_open(seq)
        if not self.enable_prefix_cache:
            return None
        # ``tokens`` may stop short of kv_len: slots planned for a step still in flight hold
        # no KV yet, and only what is written may be shared.
        ps = self.page_size
        aligned = min(len(tokens), seq.kv_len) // ps * ps
        if aligned <= seq.num_in_tree:
            return None
        prefix: Tokens
        if type(tokens) is list:  # the tree keys tuples: converted once (the tail's key too)
            prefix = tuple(tokens) if aligned == len(tokens) else tuple(tokens[:aligned])
        else:
            prefix = tokens[:aligned]
        # the node ending at the inserted pages, as match_prefix(prefix) would find it: the
        # same node and the same least-recently-used order, without walking the path again;
        # the insert goes on from the locked node (whose path is the first num_in_tree tokens)
        present, node = self.tree.insert_at(prefix, seq.pages[: aligned // ps], seq.lock_node)
        assert node.prefix_len == aligned and present >= seq.num_in_tree, (
            f"tree lost a locked prefix: the insert ends at {node.prefix_len} of {aligned}, "
            f"present {present}, locked {seq.num_in_tree}"
        )
        first_dup, end_dup = seq.num_in_tree // ps, present // ps
        if end_dup > first_dup:
            self.allocator.free_ids(seq.pages[first_dup:end_dup])
            shared = self.tree.path_pages(node)[first_dup:end_dup]
            seq.pages[first_dup:end_dup] = shared.tolist()
            self.page_table.set_pages(seq.row, first_dup, shared)
        self.tree.lock(node)
        self.tree.unlock(seq.lock_node)
        seq.lock_node = node
        seq.num_in_tree = aligned
        return prefix if type(prefix) is tuple else None

    def close(
        self,
        seq: SeqKV,
        tokens: Tokens | None = None,
        cache: bool = True,
        tail_scores: tuple[tuple[TokenLogprobs, ...], int] | None = None,
    ) -> None:
        """End a sequence: cache its whole pages (when ``cache`` and tokens are given) and keep
        its partly filled last page among the tails, unlock its prefix, free its own pages and
        release its table row. ``tail_scores``: the prompt scores of the positions from its
        last whole page on, and their top_k, kept with the tail."""
        self._check_open(seq)
        kept: int | None = None
        if cache and tokens is not None:
            cached = self._cache(seq, tokens)
            kept = self._keep_tail(seq, tokens, tail_scores, cached)
        self.tree.unlock(seq.lock_node)
        own = seq.pages[seq.num_in_tree // self.page_size :]
        if kept is not None:
            own = [page for page in own if page != kept]
        if own:
            self._give_back(own)
        del self._open[seq.row]
        self.page_table.release(seq.row)
        seq.pages = []
        seq.kv_len = 0
        seq.computed_len = 0
        seq.num_in_tree = 0
        seq.lock_node = self.tree.root

    def _give_back(self, pages: list[int]) -> None:
        """Free ``pages`` (a closed sequence's own, kept tails let go), minding the tail copies
        recorded for the next plan: the executor runs them after the plan's host copies in,
        which may take a freed page and write it first. A copy into one of them is forgotten;
        a page a copy reads goes to the copy's sequence in place of the page it copies into
        (it holds that KV already), and that page is freed instead."""
        if self._page_copies:
            freed = set(pages)
            self._page_copies = [copy for copy in self._page_copies if copy[1] not in freed]
            pages = [self._hand_over(page) for page in pages]
        self.allocator.free_ids(pages)

    def _hand_over(self, page: int) -> int:
        """The page to free for ``page``: itself, or the page a recorded copy from it writes,
        ``page`` taking its place in the copy's sequence."""
        copy = next((copy for copy in self._page_copies if copy[0] == page), None)
        if copy is None:
            return page
        self._page_copies.remove(copy)
        dest = copy[1]
        seq = next(seq for seq in self._open.values() if dest in seq.pages)
        index = seq.pages.index(dest)
        seq.pages[index] = page
        self.page_table.set_page(seq.row, index, page)
        return dest

    def _keep_tail(
        self,
        seq: SeqKV,
        tokens: Tokens,
        scores: tuple[tuple[TokenLogprobs, ...], int] | None,
        cached: tuple[int, ...] | None = None,
    ) -> int | None:
        """Keep the partly filled page after ``seq``'s cached whole pages (just cached by
        ``cache``) among the tails; the page kept, or None. ``cached``: the prefix ``_cache``
        just inserted, when it made one (the tail's key, without converting it again)."""
        if self.tails.max_pages <= 0:
            return None
        ps, start = self.page_size, seq.num_in_tree
        end = min(len(tokens), seq.kv_len)  # as cache(): only what is written is given
        if not start < end < start + ps or start != end // ps * ps:
            return None
        page = seq.pages[start // ps]
        if cached is not None and len(cached) == start:
            prefix = cached
        else:
            prefix = tuple(map(int, tokens[:start]))
        entry = TailPage(page, prefix, tuple(map(int, tokens[start:end])))
        if scores is not None:
            entry.scores, entry.top_k = scores
        freed = self.tails.add(entry)
        if freed:
            self._give_back(freed)
        return None if page in freed else page

    def find_tail(self, seq: SeqKV, tokens: Tokens) -> tuple[TailPage, int] | None:
        """A kept tail after ``seq``'s matched whole pages (just opened) and the number of its
        tokens ``tokens`` goes on with, or None."""
        if (
            not self.tails
            or seq.kv_len != seq.num_in_tree
            or len(seq.pages) * self.page_size != seq.kv_len
        ):
            return None
        start = seq.kv_len
        prefix = tuple(map(int, tokens[:start]))
        return self.tails.best(prefix, [int(t) for t in tokens[start : start + self.page_size]])

    def tail_match_length(self, tokens: Tokens, matched: int) -> int:
        """Tokens after the first ``matched`` (whole pages, as ``match_length`` gives) that a
        kept tail shares with ``tokens``; no side effects."""
        if not self.tails or matched % self.page_size:
            return 0
        prefix = tuple(map(int, tokens[:matched]))
        found = self.tails.best(
            prefix, [int(t) for t in tokens[matched : matched + self.page_size]]
        )
        return 0 if found is None else found[1]

    def take_tail(self, seq: SeqKV, entry: TailPage, num_tokens: int) -> bool:
        """Give ``seq`` (just opened, ``find_tail`` found ``entry``) a page of its own holding
        the KV of ``entry``'s first ``num_tokens`` tokens: copied from the tail's page before
        the next plan's forward. False (nothing changed) when no page can be had."""
        self._check_open(seq)
        assert 0 < num_tokens <= len(entry.tokens) and seq.kv_len == len(entry.prefix)
        self.tails.touch(entry)
        if self.allocator.num_free == 0 and self._reclaim(1) == 0:
            return False
        (page,) = self.allocator.alloc_ids(1)
        self.page_table.set_page(seq.row, len(seq.pages), page)
        seq.pages.append(page)
        self._page_copies.append((entry.page, page))
        seq.kv_len += num_tokens
        seq.computed_len += num_tokens
        seq.num_cached += num_tokens
        seq.tail_tokens = num_tokens
        return True

    def note_shared(self, seq: SeqKV, num_tokens: int) -> None:
        """``num_tokens`` of ``seq``'s positions after its match get their KV by copy from
        another sequence of the same step (step_shares.py): cache hits (``count_admitted``)."""
        seq.num_cached += num_tokens
        self.in_step_shared_tokens += num_tokens

    def count_admitted(self, seq: SeqKV, num_tokens: int) -> None:
        """Count the prompt of a sequence whose request was admitted (the first time): its
        ``num_tokens`` tokens, ``seq.num_cached`` of them cache hits (those on pages copied
        back from the host tier and not counted yet host-tier hits too), the rest computed."""
        self.hit_tokens += seq.num_cached
        self.miss_tokens += num_tokens - seq.num_cached
        self.tails.hit_tokens += seq.tail_tokens
        if self._host_pages:
            host = self._host_pages.intersection(seq.pages[: seq.num_cached // self.page_size])
            self._host_pages -= host
            self.host_hit_tokens += len(host) * self.page_size

    def drain_page_copies(self) -> list[tuple[int, int]]:
        """The tail-page copies recorded since the last call, for the next plan."""
        copies, self._page_copies = self._page_copies, []
        return copies

    def _reclaim(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages (kept tails first, then LRU tree leaves; fewer when
        fewer can go); how many were freed."""
        freed: list[int] = []
        while len(freed) < num_pages and self.tails:
            freed.append(self.tails.pop_lru())
        if freed:
            self._give_back(freed)
        if len(freed) < num_pages:
            evicted = self.tree.evict_ids((num_pages - len(freed)) * self.page_size)
            self.allocator.free_ids(evicted)
            self._host_pages.difference_update(evicted)
            return len(freed) + len(evicted)
        return len(freed)

    def swap_out(self, seq: SeqKV) -> SwappedKV | None:
        """Record the copy of ``seq``'s computed KV to host pages (the executor runs it before
        the next plan's forward); None when there is no swap space or too little of it. The
        caller then closes ``seq`` as it would for recompute."""
        self._check_open(seq)
        pages = -(-seq.computed_len // self.page_size)
        if self.swap is None or pages == 0:
            return None
        return self.swap.swap_out(seq.pages[:pages], seq.computed_len)

    def swap_in(self, seq: SeqKV, swapped: SwappedKV, restored_from: int) -> None:
        """Record the copy back of ``swapped`` into ``seq``, just opened with ``restored_from``
        tokens from the prefix cache and extended over at least ``swapped.computed_len``."""
        self._check_open(seq)
        assert self.swap is not None and seq.kv_len >= swapped.computed_len
        first, end = restored_from // self.page_size, -(-swapped.computed_len // self.page_size)
        self.swap.swap_in(swapped, first, seq.pages[first:end])

    def evict(self, num_pages: int) -> int:
        """Evict at least ``num_pages`` unlocked cached pages (kept tails, then LRU leaves,
        fewer when fewer are evictable) back to the free list; returns how many were freed."""
        return self._reclaim(num_pages)

    # ----------------------------------------------------------------------------- eviction

    def _eviction_counts(self) -> dict[str, int]:
        return {**self.ledger.counts(), "hit_tokens": self.hit_tokens}

    def set_eviction_rule(self, rule: EvictionRule) -> str:
        """Order evictions by ``rule`` from now on; returns the name of the rule it replaces."""
        previous = self.tree.rule.name
        self.eviction_by_rule = self.eviction_stats()
        self.tree.set_rule(rule)
        self._rule_began = self._eviction_counts()
        return previous

    def eviction_stats(self) -> dict[str, dict[str, int]]:
        """Evictions, evicted tokens, tokens computed again after an eviction, and prefix-cache
        hit tokens, by the rule that was in charge when they happened."""
        by_rule = {name: dict(counts) for name, counts in self.eviction_by_rule.items()}
        now = self._eviction_counts()
        live = by_rule.setdefault(self.tree.rule.name, dict.fromkeys(now, 0))
        for key, value in now.items():
            live[key] = live.get(key, 0) + value - self._rule_began[key]
        return by_rule

    # ----------------------------------------------------------------------------- pins

    def pin(self, tokens: Tokens, expires_at: float | None = None) -> Pin:
        """Keep the cached whole pages of ``tokens`` out of eviction (PinLimitError when
        nothing of them is cached or the pool's pinned share would be exceeded)."""
        if not self.enable_prefix_cache:
            raise PinLimitError("the prefix cache is off: there is nothing to pin")
        end = len(tokens) // self.page_size * self.page_size
        matched = self.tree.prefix_length(tokens, end)
        if matched == 0:
            raise PinLimitError("no page of this prefix is cached: run it once, then pin it")
        self.pins.check_room(matched // self.page_size)
        _, matched, node = self.tree.match_prefix(tokens, matched)
        pin = self.pins.add(node, self.page_size, expires_at)
        self.tree.lock(node)
        return pin

    def unpin(self, pin_id: int) -> Pin:
        """Let a pin's pages be evicted again (KeyError: no such pin)."""
        pin = self.pins.remove(pin_id)
        self.tree.unlock(pin.node)
        return pin

    def expire_pins(self, now: float) -> int:
        """Unpin the pins past their time to live; how many."""
        due = self.pins.due(now)
        for pin in due:
            self.tree.unlock(pin.node)
        return len(due)

    def _check_open(self, seq: SeqKV) -> None:
        if self._open.get(seq.row) is not seq:
            raise ValueError(f"sequence in row {seq.row} is not open in this manager")

    # ----------------------------------------------------------------------------- accounting

    def stats(self) -> dict[str, int]:
        cached = self.tree.total_size // self.page_size
        free = self.allocator.num_free
        tails = len(self.tails)
        return {
            "pages_total": self.num_pages,
            "pages_free": free,
            "pages_used": self.num_pages - free - cached - tails,
            "pages_tail": tails,
            "tail_hit_tokens": self.tails.hit_tokens,
            "in_step_shared_tokens": self.in_step_shared_tokens,
            "pages_cached": cached,
            "pages_evictable": self.tree.evictable_size // self.page_size,
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "host_hit_tokens": self.host_hit_tokens,
            **(self.host_tier.stats() if self.host_tier is not None else {}),
            "pinned_prefixes": len(self.pins),
            "pages_pinned": self.pins.pages,
            **self.ledger.counts(),
            **(self.swap.stats() if self.swap is not None else {}),
        }

    def reset(self, reset_counters: bool = False) -> None:
        """Drop the whole prefix cache and free every page; only when no sequence is open.
        ``reset_counters``: every hit, miss and eviction count starts again too (a replay's
        next run)."""
        if self._open:
            raise RuntimeError(f"reset() with {len(self._open)} sequences still open")
        for pin in self.pins.clear():
            self.tree.unlock(pin.node)
        if self.host_tier is not None:
            self.host_tier.clear()
        self.tree.reset()
        self.tails.clear()
        self._page_copies.clear()
        self._host_pages.clear()
        self.allocator.reset()
        self.page_table.reset()
        if reset_counters:
            self.hit_tokens = 0
            self.miss_tokens = 0
            self.in_step_shared_tokens = 0
            self.host_hit_tokens = 0
            self.tails.hit_tokens = 0
            self.ledger = self.tree.ledger = EvictionLedger(self.page_size)

    def check_invariant(self) -> None:
        """Assert the page accounting invariant; raises AssertionError saying what broke."""
        ps = self.page_size
        # -1 nobody, -2 free, -3 tree, -4 kept tail, else the row of the sequence holding it
        owner = np.full(self.num_pages, -1, dtype=np.int64)

        def claim(pages: np.ndarray, who: int, what: str) -> None:
            assert pages.size == 0 or (pages.min() >= 0 and pages.max() < self.num_pages), (
                f"{what}: page ids out of range: {pages.tolist()[:8]}"
            )
            values, counts = np.unique(pages, return_counts=True)
            assert (counts == 1).all(), f"{what}: pages listed twice: {values[counts > 1][:8]}"
            clash = pages[owner[pages] != -1]
            assert clash.size == 0, (
                f"{what}: pages {clash[:8].tolist()} already belong to "
                f"{self._owner_name(int(owner[clash[0]]))}"
            )
            owner[pages] = who

        free_pages = self.allocator.free_pages()
        claim(free_pages, -2, "free list")
        mask = self.allocator.allocated_mask()
        assert not mask[free_pages].any(), "free list holds pages marked allocated"
        assert int(mask.sum()) == self.num_pages - free_pages.size, (
            "allocated mask count disagrees with the free list"
        )

        self.tree.check()
        claim(self.tree.all_pages(), -3, "radix tree")
        stray = [page for page in self._host_pages if owner[page] != -3]
        assert not stray, f"pages {stray[:8]} counted as copied back are not the tree's"
        tree_pages = self.tree.total_size // ps
        tail_pages = np.asarray(self.tails.pages(), dtype=np.int64)
        claim(tail_pages, -4, "kept tails")
        assert self.tree.total_size % ps == 0, f"tree size {self.tree.total_size} not page aligned"

        expected_locks: dict[int, int] = {}
        for row, seq in self._open.items():
            name = f"seq in row {row}"
            assert seq.row == row, f"{name} says it is in row {seq.row}"
            assert self.page_table.is_in_use(row), f"{name}: its table row is not in use"
            assert len(seq.pages) == -(-seq.kv_len // ps), (
                f"{name}: {len(seq.pages)} pages for kv_len {seq.kv_len} (page_size {ps})"
            )
            assert seq.num_in_tree % ps == 0 and seq.num_in_tree <= seq.kv_len, (
                f"{name}: num_in_tree {seq.num_in_tree} not page aligned or above kv_len"
            )
            assert seq.lock_node.prefix_len == seq.num_in_tree, (
                f"{name}: lock node ends at {seq.lock_node.prefix_len}, "
                f"num_in_tree is {seq.num_in_tree}"
            )
            in_tree = seq.num_in_tree // ps
            path = self.tree.path_pages(seq.lock_node)
            assert path.tolist() == seq.pages[:in_tree], (
                f"{name}: its first {in_tree} pages are not the tree's pages on its lock path"
            )
            own = np.asarray(seq.pages[in_tree:], dtype=np.int64)
            claim(own, row, name)
            if self.page_table.stores_pages:  # else rows only (the simulator's)
                table = self.page_table.row_pages(row, len(seq.pages))
                assert table.tolist() == seq.pages, f"{name}: page-table row differs from its pages"
            node = seq.lock_node
            while node is not self.tree.root:
                expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
                assert node.parent is not None, f"{name}: lock node is detached from the tree"
                node = node.parent

        for pin in self.pins:  # a pin locks its path as a sequence does
            node = pin.node
            while node is not self.tree.root:
                expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
                assert node.parent is not None, f"pin {pin.pin_id} is detached from the tree"
                node = node.parent
        for node in self.tree.iter_nodes():
            expected = expected_locks.get(id(node), 0)
            assert node.lock_ref == expected, (
                f"{node!r}: lock_ref {node.lock_ref}, but {expected} open sequences lock it"
            )
        for source, dest in self._page_copies:  # copied before the next forward
            assert owner[dest] >= 0, (
                f"a tail copy from page {source} is recorded into page {dest}, which belongs to "
                f"{self._owner_name(int(owner[dest]))}, not to a live sequence"
            )
            assert owner[source] == -4 or owner[source] >= 0, (
                f"a tail copy into page {dest} reads page {source}, which belongs to "
                f"{self._owner_name(int(owner[source]))}, not to a kept tail or a live sequence"
            )
        nobody = np.flatnonzero(owner == -1)
        assert nobody.size == 0, (
            f"pages {nobody[:8].tolist()} are neither free, in the tree nor held by a sequence "
            f"(leaked)"
        )
        held = int((owner >= 0).sum())
        assert free_pages.size + held + tree_pages + tail_pages.size == self.num_pages, (
            f"free {free_pages.size} + held {held} + tree {tree_pages} "
            f"+ tails {tail_pages.size} != {self.num_pages}"
        )
        if self.swap is not None:
            self.swap.check()
        stats = self.stats()
        assert stats["pages_used"] == held, (
            f"stats pages_used {stats['pages_used']} != pages held by sequences {held}"
        )

    @staticmethod
    def _owner_name(owner: int) -> str:
        if owner == -2:
            return "the free list"
        if owner == -3:
            return "the radix tree"
        if owner == -4:
            return "the kept tails"
        return f"the seq in row {owner}"
