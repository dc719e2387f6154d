"""dfs-weight: run requests that share a prefix together, heaviest shared subtree first.

The waiting prompts form a trie (keyed by page-sized token blocks); a node's weight is the
number of waiting requests below it, plus a bonus for a prefix already in the radix cache.
A depth-first walk that visits heavier children first yields the admission order, so
siblings are admitted back to back and each shared prefix is computed once while it is hot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncengine.request import Request
from policies.base import Policy, PolicyContext, take_options


@dataclass(slots=True, eq=False)
class _Node:
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    ending: list[Request] = field(default_factory=list)  # requests whose prompt ends here
    weight: float = 0.0
    first_arrival: float = float("inf")


class DFSWeightPolicy(Policy):
    name = "dfs-weight"
    orders = True

    def __init__(self, **options: Any) -> None:
        opts = take_options(self.name, options, {"block_tokens": 16, "cached_bonus": 0.5})
        if opts["block_tokens"] < 1:
            raise ValueError("policy 'dfs-weight': option 'block_tokens' must be >= 1")
        self.block = opts["block_tokens"]
        self.cached_bonus = opts["cached_bonus"]

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        if len(waiting) < 2:
            return waiting
        root = _Node()
        block = self.block
        for req in waiting:
            ids = req.all_ids
            bonus = self.cached_bonus if ctx.prefix_len(ids) > 0 else 0.0
            node = root
            node.weight += 1 + bonus
            node.first_arrival = min(node.first_arrival, req.arrival_time)
            for start in range(0, len(ids) - len(ids) % block, block):
                node = node.children.setdefault(tuple(ids[start : start + block]), _Node())
                node.weight += 1 + bonus
                node.first_arrival = min(node.first_arrival, req.arrival_time)
            node.ending.append(req)
        ordered: list[Request] = []
        stack = [root]
        while stack:
            node = stack.pop()
            ordered.extend(sorted(node.ending, key=lambda r: r.arrival_time))
            # push lightest first so the heaviest child is popped (visited) first
            kids = sorted(node.children.values(), key=lambda n: (n.weight, -n.first_arrival))
            stack.extend(kids)
        return ordered
