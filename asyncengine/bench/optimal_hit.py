"""The offline upper bound on prefix-cache hits for a set of requests.

Model (the KV cache manager's rules, with a cache large enough never to evict): a prompt of
length L matches at most ``L - 1`` cached tokens, so its last token is always computed; the
cache holds every sequence a request ran, its prompt and its generated tokens (a chat's next
turn sends the previous answer back, and finds it cached). With ``page_size`` P only whole
pages are shared: a sequence inserts its full pages, a prompt's partial last page is never
shared. The engine also shares partial pages (kept tail pages, cache/tail_pages.py; copies
within a step, scheduler/step_shares.py), so the bound of a run is the one with P = 1.

Call the whole pages of the sequences (prompt + output) the nodes of a page trie. A node that
holds an output token of a request passing through it is made by that request's decoding; any
other node on a prompt's path is made only by computing some prompt, so it is computed at least
once. A prompt whose length is a multiple of P computes its own last page whatever ran before
it (that page holds its last token). So node n costs at least ``k_n`` page computations if
decoding makes it and ``max(1, k_n)`` if not, where ``k_n`` counts the prompts ending exactly
at n. Hence

    best hit tokens <= sum(L) - sum(L mod P) - P * sum_n cost(n)

Without outputs the bound is reached by running the prompts shortest first: every prompt finds
all its ancestors' pages inserted by the shorter prompts before it.
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


def optimal_hit(
    prompts: Iterable[Sequence[int]],
    page_size: int = 1,
    outputs: Sequence[Sequence[int]] | None = None,
) -> OptimalHit:
    """Best total cached-prefix tokens over all processing orders (see the module notes).
    ``outputs[i]``: the tokens generated after ``prompts[i]`` (None: nothing generated is
    ever sent again in a prompt)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    node_ids: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent node, page tokens) -> node
    on_prompts: set[int] = set()  # nodes on some prompt's path
    decoded: set[int] = set()  # nodes holding an output token of a request through them
    ending_counts: dict[int, int] = {}  # node -> prompts whose last token ends that page
    prompt_tokens = 0
    tail_tokens = 0
    for index, prompt in enumerate(prompts):
        length = len(prompt)
        prompt_tokens += length
        tail_tokens += length % page_size
        output = outputs[index] if outputs is not None else ()
        sequence = [*prompt, *output] if output else prompt
        node = -1  # the root
        for start in range(0, len(sequence) - len(sequence) % page_size, page_size):
            key = (node, tuple(sequence[start : start + page_size]))
            node = node_ids.setdefault(key, len(node_ids))
            if start + page_size > length:
                decoded.add(node)
            else:
                on_prompts.add(node)
            if start + page_size == length:
                ending_counts[node] = ending_counts.get(node, 0) + 1
    once = len(on_prompts - decoded)  # computed by some prompt, at least once
    repeated_endings = sum(count - (node not in decoded) for node, count in ending_counts.items())
    computed = tail_tokens + page_size * (once + repeated_endings)
    return OptimalHit(prompt_tokens, prompt_tokens - computed, len(on_prompts))
