"""dfs-weight: run requests that share a prefix together, cached subtrees first, then heaviest.

The waiting prompts form a trie (keyed by ``block_tokens``-token blocks, see ``prompt_trie``).
A depth-first walk yields the admission order: at each node the prompts that end there, then
the children, those the radix cache reaches into (their next page is cached) before the others,
as SGLang's DFS over the radix tree (whose children are all cached) does; each class heaviest
first (most waiting requests below), then oldest first. Siblings are admitted back to back, so
each shared prefix is computed once while it is hot, and a group that has started (its prefix
now cached) is finished before a fresh group of the same size can evict that prefix.
"""

from __future__ import annotations

from typing import Any

from asyncengine.common.request import Request
from asyncengine.policies.base import Policy, PolicyContext, take_options
from asyncengine.policies.prompt_trie import BlockChains, TrieNode, build_trie


class DFSWeightPolicy(Policy):
    name = "dfs-weight"
    orders = True
    sees_decodes = False  # Policy.sees_decodes: it reads no decode

    def __init__(self, **options: Any) -> None:
        opts = take_options(self.name, options, {"block_tokens": 16})
        if opts["block_tokens"] < 1:
            raise ValueError("policy 'dfs-weight': option 'block_tokens' must be >= 1")
        self.block = opts["block_tokens"]
        self.chains = BlockChains(self.block)

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        if len(waiting) < 2:
            return waiting
        self.chains.forget_all_but(waiting)
        root = build_trie(waiting, self.chains)
        root.hot = True  # the empty prefix: trivially cached
        block, page = self.block, ctx.config.page_size
        prefix_len = ctx.prefix_len
        ordered: list[Request] = []
        # what is left to emit, the next on top: a subtree, a request, or a run of requests
        stack: list[TrieNode | Request | list[Request]] = [root]
        while stack:
            item = stack.pop()
            if type(item) is Request:
                ordered.append(item)
                continue
            if type(item) is list:
                ordered.extend(item)
                continue
            node: TrieNode = item  # type: ignore[assignment]
            if node.ending:
                if len(node.ending) > 1:
                    node.ending.sort(key=_position)
                ordered.extend(req for _, req in node.ending)
            # Is a child cached beyond ``start``? The cache matches whole pages of at most
            # len - 1 tokens, so the first ``start + page + 1`` tokens are enough to ask;
            # below an uncached node nothing is cached, so there is no need to ask.
            cached = node.hot
            start = node.depth * block
            probe = start + page + 1
            # (cached, requests below, -queue position of the oldest, index into ``ranked``)
            keys: list[tuple[bool, int, int, int]] = []
            ranked: list[TrieNode | Request] = []
            for child in node.children:
                rep = child.representative
                assert rep is not None  # every node but an empty root holds a request
                child.hot = cached and prefix_len(rep.cache_ids[:probe]) > start
                keys.append((child.hot, child.count, -child.first_position, len(ranked)))
                ranked.append(child)
            # singles (one request, root only) rank below every group unless cached; the
            # cold ones keep their queue order, which is already theirs
            cold: list[Request] = []
            for position, req in node.singles:
                if cached and prefix_len(req.cache_ids[:probe]) > start:
                    keys.append((True, 1, -position, len(ranked)))
                    ranked.append(req)
                else:
                    cold.append(req)
            if cold:
                stack.append(cold)
            keys.sort()  # ascending: the last pushed, popped first, is the best
            stack.extend([ranked[key[3]] for key in keys])
        return ordered


def _position(entry: tuple[int, Request]) -> int:
    return entry[0]
