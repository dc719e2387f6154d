"""POST /v1/embeddings and engine.embed through the openai client, on the tiny Llama: shape,
unit length, batching, token-id input, base64, refusals, and equality with HF transformers'
pooled last hidden state, with the prefix cache on and off, chunked and not."""

from __future__ import annotations

import math
from pathlib import Path

import aiohttp
import numpy as np
import openai
import pytest

from asyncengine.api.engine import AsyncEngine
from tests.openai_server import client, server  # noqa: F401  (fixtures)
from tests.server_support import (
    RunningServer,
    assert_no_leak,
    engine_config,
    engine_idle,
    tiny_model_dir,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size pages.",
    "hi",
    "A longer sentence about radix trees, prefix caches and the requests that share them "
    "across several pages of tokens, long enough to be chunked.",
]


def hf_embeddings(model_dir: Path, token_lists: list[list[int]], pooling: str) -> np.ndarray:
    """The pooled, normalized final hidden states as HF transformers computes them."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in token_lists:
            hidden = model(torch.tensor([ids])).last_hidden_state[0].double()
            pooled = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]
            rows.append((pooled / pooled.norm()).numpy())
    return np.stack(rows)


async def test_shape_unit_length_and_usage(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    response = await client.embeddings.create(
        input=TEXTS[0], model=server.model, encoding_format="float"
    )
    assert response.object == "list" and response.model == server.model
    assert len(response.data) == 1 and response.data[0].index == 0
    vector = response.data[0].embedding
    assert len(vector) == 64  # the tiny model's hidden size
    assert math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-6)
    prompt_tokens = len(server.engine.tokenize(TEXTS[0]))
    assert response.usage.prompt_tokens == response.usage.total_tokens == prompt_tokens
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)


async def test_a_batch_equals_each_alone_and_hf_transformers(
    client: openai.AsyncOpenAI, server: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    batch = await client.embeddings.create(input=TEXTS, model=server.model)  # base64 on the wire
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    together = np.array([d.embedding for d in batch.data])
    alone = np.array(
        [
            (
                await client.embeddings.create(
                    input=text, model=server.model, encoding_format="float"
                )
            )
            .data[0]
            .embedding
            for text in TEXTS
        ]
    )
    np.testing.assert_allclose(together, alone, atol=2e-5)
    ids = [server.engine.tokenize(text) for text in TEXTS]
    reference = hf_embeddings(tiny_model_dir(tmp_path_factory), ids, "mean")
    np.testing.assert_allclose(together, reference, atol=1e-4)
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids)
    # token ids, one list and a list of lists, give the same vectors as the text
    one = await client.embeddings.create(input=ids[1], model=server.model, encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, together[1], atol=2e-5)
    lists = await client.embeddings.create(
        input=ids[:2], model=server.model, encoding_format="float"
    )
    np.testing.assert_allclose([d.embedding for d in lists.data], together[:2], atol=2e-5)


async def test_bad_requests_are_refused(client: openai.AsyncOpenAI, server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        await client.embeddings.create(input="hi", model=server.model, dimensions=16)
    for bad in ([], "", [[]], ["a", 3], [49152 + 7]):
        with pytest.raises(openai.BadRequestError):
            await client.embeddings.create(input=bad, model=server.model)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.embeddings.create(input=[[5, 49152]], model=server.model)
    assert refused.value.param == "input"
    with pytest.raises(openai.BadRequestError, match="context"):
        await client.embeddings.create(input=[1] * 2000, model=server.model)
    with pytest.raises(openai.BadRequestError, match="context"):  # one prompt, not 3000 items
        await client.embeddings.create(input=[1] * 3000, model=server.model)
    # a wrong size is refused after one item, not after all of them
    misses = server.engine.stats()["miss_tokens"]
    many = [f"{i} {TEXTS[1]}" for i in range(40)]
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        await client.embeddings.create(input=many, model=server.model, dimensions=16)
    assert server.engine.stats()["miss_tokens"] - misses <= 2 * len(server.engine.tokenize(many[0]))
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(input="hi", model="not-this-one")
    async with aiohttp.ClientSession() as session:
        url = server.base_url + "/v1/embeddings"
        async with session.post(url, json={"input": "hi", "encoding_format": "hex"}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "encoding_format"
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)


@pytest.mark.parametrize("pooling", ["mean", "last"])
async def test_prefix_cache_and_chunking_do_not_change_the_result(
    pooling: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_dir = tiny_model_dir(tmp_path_factory)
    text = " ".join(TEXTS)  # about 50 tokens: several pages, three chunks
    vectors = {}
    for cache in (True, False):
        config = engine_config(
            model_dir, embedding_pooling=pooling, enable_prefix_cache=cache, chunked_prefill_size=16
        )
        async with AsyncEngine(config) as engine:
            first = await engine.embed(text)
            # the same prompt again, now in the cache (a generation over it first, too)
            await engine.generate(text + " and more")
            second = await engine.embed(text)
            # last-token pooling takes all but the last token: the whole pages from the tree,
            # the rest from the first embedding's kept tail page
            whole = len(engine.tokenize(text)) - 1
            assert second.cached_tokens == (0 if pooling == "mean" or not cache else whole)
            np.testing.assert_allclose(second.embedding, first.embedding, atol=2e-5)
            vectors[cache] = first.embedding
            ids = engine.tokenize(text)
            assert await wait_until(lambda engine=engine: engine_idle(engine))
            assert_no_leak(engine)
    np.testing.assert_allclose(vectors[True], vectors[False], atol=2e-5)
    reference = hf_embeddings(model_dir, [ids], pooling)[0]
    np.testing.assert_allclose(vectors[True], reference, atol=1e-4)
