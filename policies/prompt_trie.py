"""A compressed trie of waiting prompts, keyed by fixed-size token blocks.

Every prompt is cut into whole blocks (a trailing partial block is ignored) and summarized by
its chain of cumulative block hashes: entry k hashes blocks 0..k, so two prompts share their
first k blocks exactly when their chains agree at entry k - 1 (up to a hash collision, which
could only misplace a request in a scheduling order). Chains are computed once per request and
kept while it waits (``BlockChains``), so building the trie for a queue that barely changes
between steps costs a dictionary pass, a sort of the requests that share a first block, and a
binary search per adjacent pair, instead of hashing every block of every prompt again.

Prompts that share no first block with another one hang under the root as ``singles`` (no node
of their own: most of a queue without shared prefixes); the others are grouped, sorted by chain
and assembled with a stack from adjacent common lengths (the usual construction of a compressed
trie from sorted keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.common.request import Request

_NO_POSITION = 1 << 62


@dataclass(slots=True, eq=False)
class TrieNode:
    """A branch point (or the end of some prompts) after ``depth`` blocks from the root."""

    depth: int
    children: list[TrieNode] = field(default_factory=list)
    # (queue position, request) of leaf children that hold one request and share no block with
    # any other, in queue order: the root's only (its other children hold groups of 2 or more)
    singles: list[tuple[int, Request]] = field(default_factory=list)
    # (queue position, request) of the prompts with exactly ``depth`` blocks
    ending: list[tuple[int, Request]] = field(default_factory=list)
    count: int = 0  # requests at or below this node
    first_position: int = _NO_POSITION  # queue position of the oldest request at or below
    representative: Request | None = None  # one request at or below, to probe its prefix
    hot: bool = False  # for the walker: whether the cache reaches into this node's edge


class BlockChains:
    """Cumulative block hashes of each waiting request, memoized while its tokens stay the same."""

    def __init__(self, block_tokens: int) -> None:
        self.block = block_tokens
        self._memo: dict[Request, tuple[int, list[int]]] = {}

    def chain(self, req: Request) -> list[int]:
        entry = self._memo.get(req)
        num_outputs = len(req.output_ids)
        if entry is not None and entry[0] == num_outputs:
            return entry[1]
        ids = req.cache_ids
        block = self.block
        chain = []
        running = 0
        for start in range(0, len(ids) - block + 1, block):
            running = hash((running, tuple(ids[start : start + block])))
            chain.append(running)
        self._memo[req] = (num_outputs, chain)
        return chain

    def chains(self, requests: list[Request]) -> list[list[int]]:
        """``chain`` of each request (one call for a whole queue: the memo hits inline)."""
        memo_get = self._memo.get
        found = []
        for req in requests:
            entry = memo_get(req)
            if entry is not None and entry[0] == len(req.output_ids):
                found.append(entry[1])
            else:
                found.append(self.chain(req))
        return found

    def forget_all_but(self, keep: list[Request]) -> None:
        """Drop the chains of requests no longer waiting, once the memo has grown well past
        the queue it serves (amortized: not on every call)."""
        if len(self._memo) > 2 * len(keep) + 256:
            kept = set(keep)
            self._memo = {req: entry for req, entry in self._memo.items() if req in kept}


def _common_blocks(a: list[int], b: list[int]) -> int:
    """How many leading blocks two chains share (cumulative hashes: a binary search)."""
    high = min(len(a), len(b))
    if high == 0 or a[0] != b[0]:
        return 0
    if a[high - 1] == b[high - 1]:
        return high
    low = 1  # a[low - 1] == b[low - 1] and a[high - 1] != b[high - 1]
    while high - low > 1:
        mid = (low + high) // 2
        if a[mid - 1] == b[mid - 1]:
            low = mid
        else:
            high = mid
    return low


def _leaf(position: int, req: Request, depth: int) -> TrieNode:
    return TrieNode(
        depth=depth, ending=[(position, req)], count=1, first_position=position, representative=req
    )


def _attach(parent: TrieNode, child: TrieNode) -> None:
    parent.children.append(child)
    parent.count += child.count
    if child.first_position < parent.first_position:
        parent.first_position = child.first_position
    if parent.representative is None:
        parent.representative = child.representative


def _add_ending(node: TrieNode, position: int, req: Request) -> None:
    node.ending.append((position, req))
    node.count += 1
    if position < node.first_position:
        node.first_position = position
    if node.representative is None:
        node.representative = req


Member = tuple[list[int], int, Request]  # chain, queue position, request


def _subtree(group: list[Member]) -> TrieNode:
    """The compressed trie of requests sharing their first block."""
    group.sort(key=lambda member: member[0])
    stack = [TrieNode(depth=1)]  # the node after the shared first block
    previous: list[int] | None = None
    for chain, position, req in group:
        common = 1 if previous is None else _common_blocks(previous, chain)
        previous = chain
        popped: TrieNode | None = None
        while stack[-1].depth > common:
            popped = stack.pop()
            if stack[-1].depth >= common:
                _attach(stack[-1], popped)
                popped = None
        if popped is not None:  # the branch point lies inside popped's edge
            middle = TrieNode(depth=common)
            _attach(middle, popped)
            stack.append(middle)
        if len(chain) == common:
            _add_ending(stack[-1], position, req)
        else:
            stack.append(_leaf(position, req, len(chain)))
    while len(stack) > 1:
        node = stack.pop()
        _attach(stack[-1], node)
    top = stack[0]
    if len(top.children) == 1 and not top.ending:
        return top.children[0]  # the group shares more than its first block
    return top


def build_trie(requests: list[Request], chains: BlockChains) -> TrieNode:
    """The compressed trie of ``requests``' whole-block prompts (depths in blocks); a
    request's queue position is its index in ``requests``."""
    root = TrieNode(depth=0)
    all_chains = chains.chains(requests)
    first_at: dict[int, int] = {}  # first block -> position of its first request
    more_at: dict[int, list[int]] = {}  # first block -> positions of the others, if any
    for position, chain in enumerate(all_chains):
        if not chain:
            _add_ending(root, position, requests[position])
        elif chain[0] not in first_at:
            first_at[chain[0]] = position
        else:
            more_at.setdefault(chain[0], []).append(position)
    for head, first in first_at.items():
        more = more_at.get(head)
        if more is None:
            root.singles.append((first, requests[first]))
        else:
            members = [(all_chains[p], p, requests[p]) for p in (first, *more)]
            _attach(root, _subtree(members))
    root.count = len(requests)
    return root
