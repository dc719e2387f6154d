"""The Python API tokenizes a text prompt as vLLM's ``LLM.generate`` does: with the special
tokens its tokenizer adds (a BOS), unless ``SamplingParams(add_special_tokens=False)`` (or
``tokenize(..., add_special_tokens=False)``) says not to; token ids are queued as given and chat
messages get only what their template writes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from asyncengine import AsyncEngine, EngineConfig, InvalidRequestError, SamplingParams
from asyncengine.server.ray_serve.remote_engine import route_ids
from tests.server_support import BOS, bos_model_dir, engine_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXT = "The story goes on, and on, and on"
USER: Any = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
PLAIN = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, add_special_tokens=False)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[AsyncEngine]:
    """The tiny model with a tokenizer that puts a BOS before a text it adds specials to."""
    async with AsyncEngine(engine_config(bos_model_dir(tmp_path_factory))) as started:
        yield started


def _bos(engine: AsyncEngine) -> int:
    return int(engine.tokenizer.backend.token_to_id(BOS))


async def test_a_text_prompt_gets_the_bos_unless_told_not_to(engine: AsyncEngine) -> None:
    plain = engine.tokenizer.encode(TEXT)
    assert plain[0] != _bos(engine)
    assert engine.tokenize(TEXT) == [_bos(engine), *plain]
    assert engine.tokenize(TEXT, add_special_tokens=False) == plain
    assert engine.tokenize(plain) == plain  # ids as given, whatever the option

    with_bos, without = await engine.generate(TEXT, GREEDY), await engine.generate(TEXT, PLAIN)
    assert with_bos.usage.prompt_tokens == len(plain) + 1
    assert without.usage.prompt_tokens == len(plain)
    # the same request as the ids it stands for
    assert with_bos.token_ids == (await engine.generate([_bos(engine), *plain], GREEDY)).token_ids
    assert without.token_ids == (await engine.generate(plain, PLAIN)).token_ids


async def test_stream_choices_and_embeddings_follow_the_option(engine: AsyncEngine) -> None:
    plain = len(engine.tokenizer.encode(TEXT))
    for params, tokens in ((GREEDY, plain + 1), (PLAIN, plain)):
        last = None
        async for delta in engine.stream(TEXT, params):
            last = delta
        assert last is not None and last.usage is not None
        assert last.usage.prompt_tokens == tokens
        two = SamplingParams(n=2, max_new_tokens=2, add_special_tokens=params.add_special_tokens)
        choices = await engine.generate_choices(TEXT, two)
        assert [c.usage.prompt_tokens for c in choices] == [tokens, tokens]
        embedded = await engine.embed(TEXT, params)
        assert embedded.prompt_tokens == tokens


async def test_chat_messages_get_no_bos_added(engine: AsyncEngine) -> None:
    rendered = engine.tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    ids = engine.tokenizer.encode(rendered)
    assert ids[0] == _bos(engine) and ids[1] != _bos(engine)  # the template's own, once
    assert engine.tokenize(USER) == ids
    assert engine.tokenize(USER, add_special_tokens=False) == ids
    out = await engine.generate(USER, GREEDY)
    assert out.usage.prompt_tokens == len(ids)


async def test_a_pin_keys_the_pages_generate_queues(engine: AsyncEngine) -> None:
    system = "You are a careful assistant. Answer in one short paragraph, please. " * 2
    pin = await engine.pin(system)
    tree = engine.scheduler.kv.tree
    assert tree.prefix_length(engine.tokenize(system)) == pin.tokens
    assert tree.prefix_length(engine.tokenize(system, add_special_tokens=False)) == 0
    engine.unpin(pin.pin_id)


async def test_the_router_keys_a_text_as_the_replica_tokenizes_it(engine: AsyncEngine) -> None:
    """The Ray front end routes on the ids the replica's prefix cache will hold."""
    tokenizer = engine.tokenizer
    assert route_ids(tokenizer, TEXT, SamplingParams()) == engine.tokenize(TEXT)
    assert route_ids(tokenizer, TEXT, SamplingParams(add_special_tokens=False)) == (
        engine.tokenize(TEXT, add_special_tokens=False)
    )


async def test_a_non_boolean_option_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="add_special_tokens") as refused:
        SamplingParams(add_special_tokens="no")  # type: ignore[arg-type]
    assert refused.value.param == "add_special_tokens"


async def test_the_embedded_models_greedy_output_is_the_ids_own() -> None:
    """The embedded model's tokenizer adds nothing: a text runs as its plain ids did."""
    config = EngineConfig(model="smollm2-135m", kv_cache_tokens=1024, log_interval=0)
    async with AsyncEngine(config) as embedded:
        ids = embedded.tokenizer.encode(TEXT)
        assert embedded.tokenize(TEXT) == ids
        out = await embedded.generate(TEXT, GREEDY)
        assert out.token_ids == (await embedded.generate(ids, GREEDY)).token_ids
        assert out.token_ids == (await embedded.generate(TEXT, PLAIN)).token_ids
