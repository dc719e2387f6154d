"""The compressed trie of waiting prompts that dfs-weight walks."""

from __future__ import annotations

from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.policies.prompt_trie import BlockChains, TrieNode, build_trie


def req(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(), 0.0)


def shape(node: TrieNode) -> tuple[object, ...]:
    """(depth, count, ending rids, single rids, children shapes), children in a fixed order."""
    children = sorted((shape(child) for child in node.children), key=repr)
    return (
        node.depth,
        node.count,
        sorted(r.rid for _, r in node.ending),
        sorted(r.rid for _, r in node.singles),
        children,
    )


def test_trie_of_shared_prefixes_is_compressed() -> None:
    a, b, c = [1] * 4, [2] * 4, [3] * 4  # blocks of 4 tokens
    waiting = [
        req("abc", a + b + c),
        req("ab", a + b + [9]),  # the partial last block does not count
        req("abb", a + b + b),
        req("ac", a + c),
        req("lonely", c + c),
        req("short", [7, 7]),  # no whole block: ends at the root
    ]
    root = build_trie(waiting, BlockChains(4))
    assert shape(root) == (
        0,
        6,
        ["short"],
        ["lonely"],
        [
            (
                1,
                4,
                [],
                [],
                [
                    (2, 1, ["ac"], [], []),
                    (2, 3, ["ab"], [], [(3, 1, ["abb"], [], []), (3, 1, ["abc"], [], [])]),
                ],
            )
        ],
    )


def test_identical_prompts_end_at_one_node_in_queue_order() -> None:
    shared = [5] * 8
    waiting = [req("x", shared), req("y", [6] * 8), req("z", shared)]
    root = build_trie(waiting, BlockChains(4))
    [group] = root.children
    assert group.depth == 2 and [(p, r.rid) for p, r in group.ending] == [(0, "x"), (2, "z")]
    assert group.first_position == 0 and group.representative is not None
    assert [(p, r.rid) for p, r in root.singles] == [(1, "y")]


def test_chains_follow_a_request_whose_tokens_grew() -> None:
    chains = BlockChains(2)
    request = req("r", [1, 2, 3, 4, 5])
    assert len(chains.chain(request)) == 2
    request.output_ids.extend([6, 7])  # retracted after decoding: it waits again, longer
    assert len(chains.chain(request)) == 3
    other = req("o", [1, 2, 3, 4, 9, 9])
    assert chains.chain(other)[:2] == chains.chain(request)[:2]
    assert chains.chain(other)[2] != chains.chain(request)[2]


def test_chains_forget_requests_that_left_the_queue() -> None:
    chains = BlockChains(2)
    gone = [req(f"g{i}", [i, i + 1]) for i in range(300)]
    for request in gone:
        chains.chain(request)
    kept = [req("k", [1, 2])]
    chains.chain(kept[0])
    chains.forget_all_but(kept)
    assert set(chains._memo) == set(kept)
