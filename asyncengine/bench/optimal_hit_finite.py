"""Offline bounds on prefix-cache hits when the KV pool holds only ``pool_pages`` pages.

The model is the KV cache manager's, run one request at a time (concurrency only ever takes
room from the cache, so no engine does better than the best one-at-a-time schedule):

- a prompt of L tokens matches whole cached pages of its prefix, at most L - 1 tokens (its
  first ``(L - 1) // page_size`` pages; a page counts only if every page before it matched);
- while it runs it holds ``ceil(L / page_size)`` pages (matched ones included) and the cache
  keeps at most the rest of the pool; afterwards its whole pages may be cached;
- any cached page may be dropped at any time (the engine evicts leaves, LRU; the bound may
  choose which).

Two bounds, both exact:

``order="any"`` (the best over every processing order and every eviction): with a pool that
holds the longest prompt this is the infinite-pool optimum (``optimal_hit``), reached by the
depth-first order over the trie of prompts, in which only the path to the current node has to
stay cached (SGLang's theorem). A prompt longer than the pool cannot run at all and hits
nothing. So the finite bound differs from the infinite one only through such prompts: for a
pool that can serve the trace, the order can always make up for its size.

``order="arrival"`` (the best eviction for the arrival order, the order an FCFS engine admits
in): Belady's rule, on every request drop the cached pages whose next use (the next prompt
that could match them) is farthest away, the deepest first among equal ones (a page's next use
is never later than its children's, so the cache stays a prefix tree). Its optimality is
checked against exhaustive search over every eviction on small traces. A policy that reorders
the queue can beat this bound (LPM and DFS-weight do, by running sharers together): the gap
between the two bounds is what ordering is worth with this pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from asyncengine.bench.optimal_hit import OptimalHit, optimal_hit

Order = Literal["any", "arrival"]
_NEVER = 1 << 62


@dataclass(slots=True)
class _Prompt:
    length: int
    path: list[int]  # trie node of each whole page
    matchable: int  # leading pages it may match
    need: int  # pages it holds while it runs


def _trie(prompts: Sequence[Sequence[int]], page_size: int) -> tuple[list[_Prompt], list[int]]:
    """Each prompt's page path in the trie of whole pages, and each node's depth."""
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    depth: list[int] = []
    out: list[_Prompt] = []
    for prompt in prompts:
        length = len(prompt)
        node, path = -1, list[int]()
        for start in range(0, length - length % page_size, page_size):
            key = (node, tuple(prompt[start : start + page_size]))
            if key not in ids:
                ids[key] = len(depth)
                depth.append(len(path))
            node = ids[key]
            path.append(node)
        matchable = max(length - 1, 0) // page_size
        out.append(_Prompt(length, path, matchable, -(-length // page_size)))
    return out, depth


def optimal_hit_finite(
    prompts: Sequence[Sequence[int]],
    page_size: int,
    pool_pages: int,
    order: Order = "any",
    outputs: Sequence[Sequence[int]] | None = None,
) -> OptimalHit:
    """The most prompt tokens any schedule can take from a cache of ``pool_pages`` pages
    (``order`` "any": over all orders; "arrival": in the given order). See the module notes.
    ``outputs`` (order "any" only): each prompt's generated tokens, as ``optimal_hit`` takes."""
    if page_size < 1 or pool_pages < 1:
        raise ValueError(f"page_size and pool_pages must be >= 1, got {page_size}, {pool_pages}")
    if outputs is not None and order != "any":
        raise ValueError("outputs are taken by the any-order bound only")
    if order == "any":
        return _any_order(prompts, page_size, pool_pages, outputs)
    if order == "arrival":
        return _arrival_order(prompts, page_size, pool_pages)
    raise ValueError(f"order must be 'any' or 'arrival', got {order!r}")


def _any_order(
    prompts: Sequence[Sequence[int]],
    page_size: int,
    pool_pages: int,
    outputs: Sequence[Sequence[int]] | None,
) -> OptimalHit:
    fits = [i for i, p in enumerate(prompts) if -(-len(p) // page_size) <= pool_pages]
    kept = None if outputs is None else [outputs[i] for i in fits]
    best = optimal_hit([prompts[i] for i in fits], page_size, kept)
    total = sum(len(p) for p in prompts)
    return OptimalHit(total, best.hit_tokens, best.trie_pages)


def _arrival_order(prompts: Sequence[Sequence[int]], page_size: int, pool_pages: int) -> OptimalHit:
    parsed, depth = _trie(prompts, page_size)
    # each node's uses: the prompts (by index) that may match it, in order (a prompt the pool
    # cannot hold never runs, so it uses nothing)
    uses: list[list[int]] = [[] for _ in depth]
    for index, prompt in enumerate(parsed):
        if prompt.need > pool_pages:
            continue
        for node in prompt.path[: prompt.matchable]:
            uses[node].append(index)
    cursor = [0] * len(depth)  # uses[node][cursor[node]] is its next use from now on

    def next_use(node: int, after: int) -> int:
        u, c = uses[node], cursor[node]
        while c < len(u) and u[c] <= after:
            c += 1
        cursor[node] = c
        return u[c] if c < len(u) else _NEVER

    cached: set[int] = set()
    hits = 0
    total = 0
    for index, prompt in enumerate(parsed):
        total += prompt.length
        if prompt.need > pool_pages:
            continue  # refused: it can never run
        matched = 0
        for node in prompt.path[: prompt.matchable]:
            if node not in cached:
                break
            matched += 1
        hits += matched * page_size
        pinned = set(prompt.path)
        # while it runs: the cache outside its own path must fit beside it
        _evict(
            cached,
            pinned,
            len(cached - pinned) - (pool_pages - prompt.need),
            index,
            next_use,
            depth,
        )
        cached.update(prompt.path)
        _evict(cached, set(), len(cached) - pool_pages, index, next_use, depth)
    return OptimalHit(total, hits, len(depth))


def _evict(
    cached: set[int],
    pinned: set[int],
    count: int,
    now: int,
    next_use: object,
    depth: list[int],
) -> None:
    """Drop ``count`` unpinned pages of ``cached``: farthest next use first, deepest first."""
    if count <= 0:
        return
    use = next_use  # (node, after) -> index of the next prompt that may match it
    heap = [(-use(node, now), -depth[node], node) for node in cached if node not in pinned]  # type: ignore[operator]
    heapq.heapify(heap)
    for _ in range(count):
        _, _, node = heapq.heappop(heap)
        cached.discard(node)
