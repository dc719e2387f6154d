"""The offline upper bound on prefix-cache hits for a set of prompts.

Model (the KV cache manager's rules, with a cache large enough never to evict): only whole
pages of ``page_size`` tokens are shared; a prompt of length L inserts its ``L // page_size``
full pages into the tree; a prompt can match at most ``L - 1`` tokens, so its last token is
always computed. Call the pages of the prompts the nodes of a page trie.

Every node must be computed at least once, and a prompt whose length is an exact multiple of
the page size computes its own last page whatever ran before it (that page holds its last
token). So node n costs at least ``max(1, k_n)`` page computations, where ``k_n`` counts the
prompts ending exactly at n, and a prompt's partial tail page is never shared. Running the
prompts shortest first reaches that bound: every prompt finds all its ancestors' pages
inserted by the shorter prompts before it (the inserted set is closed under prefixes). Hence

    best hit tokens = sum(L) - sum(L mod page_size) - page_size * sum_n max(1, k_n)

which for ``page_size == 1`` is ``sum(L) - (distinct trie nodes + repeated exact prompts)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OptimalHit:
    prompt_tokens: int
    hit_tokens: int
    trie_pages: int  # distinct page nodes over all prompts

    @property
    def rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def optimal_hit(prompts: Iterable[Sequence[int]], page_size: int = 1) -> OptimalHit:
    """Best total cached-prefix tokens over all processing orders (see the module notes)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    node_ids: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent node, page tokens) -> node
    ending_counts: dict[int, int] = {}  # node -> prompts whose last token ends that page
    prompt_tokens = 0
    tail_tokens = 0
    for prompt in prompts:
        length = len(prompt)
        prompt_tokens += length
        tail_tokens += length % page_size
        node = -1  # the root
        for start in range(0, length - length % page_size, page_size):
            key = (node, tuple(prompt[start : start + page_size]))
            node = node_ids.setdefault(key, len(node_ids))
        if length and length % page_size == 0:
            ending_counts[node] = ending_counts.get(node, 0) + 1
    repeated_endings = sum(count - 1 for count in ending_counts.values())
    computed = tail_tokens + page_size * (len(node_ids) + repeated_endings)
    return OptimalHit(prompt_tokens, prompt_tokens - computed, len(node_ids))
