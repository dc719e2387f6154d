"""KV cache events (cache/kv_events.py): the radix tree reports every page it stores and removes
and every reset, in vLLM's shape; a ZMQ subscriber rebuilds the cache's contents from them."""

from __future__ import annotations

import asyncio
import random

import msgspec
import numpy as np
import openai
import pytest

from asyncengine.api.engine import AsyncEngine
from asyncengine.cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    page_hashes,
)
from asyncengine.cache.radix_cache import RadixCache
from asyncengine.common.sampling_params import SamplingParams
from tests.server_support import (
    assert_no_leak,
    engine_config,
    engine_idle,
    start_server,
    tiny_model_dir,
    wait_until,
)


def tree_blocks(tree: RadixCache) -> dict[int, list[int]]:
    """Every page in ``tree``: its chained hash (computed from the tokens on its path, not the
    tree's own bookkeeping) -> its tokens."""
    ps = tree.page_size
    blocks: dict[int, list[int]] = {}
    for node in tree.iter_nodes():
        path: list[int] = []
        walk = node
        while walk is not tree.root:
            assert walk.parent is not None
            path[:0] = walk.key
            walk = walk.parent
        hashes = page_hashes(path, ps)
        for i in range(len(path) // ps - len(node.key) // ps, len(path) // ps):
            blocks[hashes[i]] = path[i * ps : (i + 1) * ps]
    return blocks


class Replay:
    """A subscriber's picture of the cache, rebuilt from events only."""

    def __init__(self) -> None:
        self.blocks: dict[int, list[int]] = {}
        self.removed = 0

    def apply(self, events: list[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                ps = event.block_size
                if event.parent_block_hash is not None:
                    assert event.parent_block_hash in self.blocks, "stored after an unknown page"
                if not event.token_ids:  # published without token ids: the hashes only
                    self.blocks.update(dict.fromkeys(event.block_hashes, []))
                    continue
                assert len(event.token_ids) == ps * len(event.block_hashes)
                assert event.block_hashes == page_hashes(
                    event.token_ids, ps, event.parent_block_hash
                )
                for i, block in enumerate(event.block_hashes):
                    self.blocks[block] = event.token_ids[i * ps : (i + 1) * ps]
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    assert self.blocks.pop(block, None) is not None, "removed an unknown page"
                    self.removed += 1
            else:
                assert isinstance(event, AllBlocksCleared)
                self.blocks.clear()


def test_hashes_chain_over_the_prefix() -> None:
    tokens = list(range(100, 164))
    whole = page_hashes(tokens, 16)
    assert len(whole) == 4 and len(set(whole)) == 4
    assert page_hashes(tokens[32:], 16, whole[1]) == whole[2:]
    assert page_hashes(tokens[:20], 16) == whole[:1]  # a partial page has no hash
    assert page_hashes([7] + tokens[1:], 16)[1:] != whole[1:]  # a change flows down the chain


def test_the_events_replay_to_the_tree_through_inserts_splits_evictions_and_resets() -> None:
    rng = random.Random(3)
    tree = RadixCache(page_size=4, events=True)
    replay = Replay()
    pages = iter(range(1_000_000))
    for round_ in range(300):
        prefix = rng.choice([[1, 2, 3, 4] * 3, [9] * 8, []])
        tokens = prefix + [rng.randrange(1, 6) for _ in range(rng.randrange(0, 24))]
        tree.insert(tokens, [next(pages) for _ in range(len(tokens) // 4)])
        if rng.random() < 0.3:
            tree.match_prefix(tokens[: rng.randrange(0, len(tokens) + 1)])  # splits
        if rng.random() < 0.3:
            tree.evict(rng.randrange(1, 40))
        if round_ % 97 == 96:
            tree.reset()
        replay.apply(tree.drain_events())
        assert replay.blocks == tree_blocks(tree)
        tree.check()
    assert tree.drain_events() == []


def test_a_tree_without_events_keeps_none() -> None:
    tree = RadixCache(page_size=4)
    tree.insert(list(range(16)), [0, 1, 2, 3])
    tree.evict(16)
    tree.reset()
    assert tree.drain_events() == []


def test_the_wire_shape_is_vllms() -> None:
    batch = KVEventBatch(
        1.5,
        [BlockStored([11, 12], None, [1, 2, 3, 4], 2, None, None), BlockRemoved([11], None)]
        + [AllBlocksCleared()],
    )
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert raw == [
        1.5,
        [
            ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, None],
            ["BlockRemoved", [11], None],
            ["AllBlocksCleared"],
        ],
        None,  # data_parallel_rank
    ]
    assert decode_batch(msgspec.msgpack.encode(batch)) == batch


@pytest.mark.asyncio
@pytest.mark.parametrize("token_ids", [False, True], ids=["hashes-only", "with-token-ids"])
async def test_a_subscriber_rebuilds_the_engines_cache(
    tmp_path_factory: pytest.TempPathFactory, token_ids: bool
) -> None:
    """By default a subscriber learns which pages are held (their hashes), never their tokens;
    with ``kv_events_token_ids`` it can rebuild the tokens too."""
    import zmq
    import zmq.asyncio

    # a small pool: the requests below overflow it, so pages are evicted too
    config = engine_config(
        tiny_model_dir(tmp_path_factory),
        kv_events="tcp://127.0.0.1:*",
        kv_cache_tokens=1024,
        kv_events_token_ids=token_ids,
    )
    running = await start_server(config)
    engine: AsyncEngine = running.engine
    assert engine.kv_events is not None
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(engine.kv_events.endpoint)
    replay = Replay()
    sequence: list[int] = []

    async def receive_until_quiet() -> None:
        while await sub.poll(500):
            topic, seq, payload = await sub.recv_multipart()
            assert topic == b""
            sequence.append(int.from_bytes(seq, "big"))
            replay.apply(decode_batch(payload).events)

    try:
        await asyncio.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher
        async with openai.AsyncOpenAI(
            base_url=running.base_url + "/v1", api_key="unused", max_retries=0
        ) as client:
            system = "You are a careful assistant. " * 8
            prompts = [f"{system} Question {i}: " + "word " * (i * 13 % 90) for i in range(24)]
            await asyncio.gather(
                *(
                    client.completions.create(prompt=p, max_tokens=8, model=running.model)
                    for p in prompts
                )
            )
            await client.embeddings.create(input=prompts[:4], model=running.model)
        assert await wait_until(lambda: engine_idle(engine))
        await receive_until_quiet()
        tree = engine.scheduler.kv.tree
        held_now = tree_blocks(tree)
        if token_ids:
            assert replay.blocks == held_now and replay.blocks
        else:  # the same pages, and not one token of any prompt
            assert set(replay.blocks) == set(held_now) and replay.blocks
            assert all(tokens == [] for tokens in replay.blocks.values())
        assert sequence == list(range(len(sequence)))
        assert replay.removed > 0  # the pool overflowed: pages were evicted
        await engine.reset_prefix_cache()
        await receive_until_quiet()
        assert replay.blocks == {} and tree_blocks(tree) == {}
        assert_no_leak(engine)
        # a router's view: a prompt's page hashes say which of its pages a replica holds
        await engine.generate(prompts[0], SamplingParams(max_new_tokens=2))
        await receive_until_quiet()
        ids = engine.tokenize(prompts[0])
        held = [h in replay.blocks for h in page_hashes(ids, config.page_size)]
        assert held[0] and np.all(held[: sum(held)])
    finally:
        sub.close(linger=0)
        context.term()
        await running.stop()


def test_the_cli_flag_turns_token_ids_on() -> None:
    import argparse

    from asyncengine.cli import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-events", "tcp://127.0.0.1:*"])
    assert engine_config_from_args(args).kv_events_token_ids is False
    args = parser.parse_args(["--kv-events", "tcp://127.0.0.1:*", "--kv-events-token-ids"])
    assert engine_config_from_args(args).kv_events_token_ids is True
