"""vLLM's extra request fields, sent as the openai client sends them (``extra_body``): the ones
honoured change the answer as in vLLM, and the ones not honoured are a 400 that names the field
when set to anything but vLLM's default (the default itself is accepted)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from tests.openai_server import bos_client, bos_server, client, server  # noqa: F401  (fixtures)
from tests.server_support import (
    BOS,
    RunningServer,
    assert_no_leak,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

USER: Any = [{"role": "user", "content": "hi"}]  # the client's message type

# (endpoint, field, a value not honoured, vLLM's default for it)
REFUSED: list[tuple[str, str, Any, Any]] = [
    *(
        (endpoint, name, value, default)
        for endpoint in ("chat", "completions")
        for name, value, default in (
            ("best_of", 2, 1),
            ("use_beam_search", True, False),
            ("length_penalty", 0.5, 1.0),
            ("logits_processors", ["my.Processor"], None),
            ("structural_tag", "{}", None),
            ("guided_whitespace_pattern", " ", None),
            ("kv_transfer_params", {"do_remote_decode": True}, None),
            ("vllm_xargs", {"x": 1}, None),
        )
    ),
    ("chat", "echo", True, False),
    ("chat", "chat_template", "{{ messages }}", None),
    ("completions", "prompt_embeds", "AAAA", None),
    ("embeddings", "normalize", False, True),
]


async def _create(
    client: openai.AsyncOpenAI, server: RunningServer, endpoint: str, **kwargs: Any
) -> str:
    """The first choice's text of a greedy request (embeddings: the vector's length)."""
    if endpoint == "embeddings":
        kwargs.pop("max_tokens", None)
        embedded = await client.embeddings.create(model=server.model, input="hi", **kwargs)
        return str(len(embedded.data[0].embedding))
    common: dict[str, Any] = {"model": server.model, "temperature": 0, **kwargs}
    if endpoint == "chat":
        chat = await client.chat.completions.create(messages=USER, **common)
        return chat.choices[0].message.content or ""
    done = await client.completions.create(prompt="The story goes", **common)
    return done.choices[0].text


@pytest.mark.parametrize(("endpoint", "name", "value", "default"), REFUSED)
async def test_a_field_not_honoured_is_a_400_naming_it(
    client: openai.AsyncOpenAI,
    server: RunningServer,
    endpoint: str,
    name: str,
    value: Any,
    default: Any,
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await _create(client, server, endpoint, max_tokens=2, extra_body={name: value})
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == name and error["code"] == "unsupported_parameter"
    assert name in error["message"]
    # vLLM's default asks for nothing this server does not do
    await _create(client, server, endpoint, max_tokens=2, extra_body={name: default})
    assert_no_leak(server.engine)


async def test_spaces_between_special_tokens_false_is_refused_only_with_special_tokens_shown(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    off = {"spaces_between_special_tokens": False}
    with pytest.raises(openai.BadRequestError) as refused:
        await _create(
            client, server, "chat", max_tokens=2, extra_body={**off, "skip_special_tokens": False}
        )
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["param"] == "spaces_between_special_tokens"
    await _create(client, server, "chat", max_tokens=2, extra_body=off)  # nothing between


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(
    client: openai.AsyncOpenAI, server: RunningServer, endpoint: str, stream: bool
) -> None:
    extra = {"ignore_eos": True}
    whole = await _create(client, server, endpoint, max_tokens=24, extra_body=extra)
    stop = _stop_string_within(whole)
    end = whole.index(stop) + len(stop)
    trimmed = await _create(client, server, endpoint, max_tokens=24, stop=stop, extra_body=extra)
    assert trimmed == whole[: end - len(stop)]
    kept = {**extra, "include_stop_str_in_output": True}
    if stream:
        text = await _streamed(client, server, endpoint, stop, kept)
    else:
        text = await _create(client, server, endpoint, max_tokens=24, stop=stop, extra_body=kept)
    assert text == whole[:end]
    assert_no_leak(server.engine)


def _stop_string_within(text: str) -> str:
    """Three characters from the middle of ``text``, none of them blank."""
    for start in range(len(text) // 3, len(text) - 3):
        piece = text[start : start + 3]
        if piece.strip() == piece and piece:
            return piece
    raise AssertionError(f"no stop string to pick in {text!r}")


async def _streamed(
    client: openai.AsyncOpenAI,
    server: RunningServer,
    endpoint: str,
    stop: str,
    extra: dict[str, Any],
) -> str:
    common: dict[str, Any] = {
        "model": server.model,
        "temperature": 0,
        "max_tokens": 24,
        "stop": stop,
        "extra_body": extra,
        "stream": True,
    }
    parts: list[str] = []
    if endpoint == "chat":
        chunks = await client.chat.completions.create(messages=USER, **common)
        async for chunk in chunks:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
    else:
        pieces = await client.completions.create(prompt="The story goes", **common)
        async for piece in pieces:
            if piece.choices:
                parts.append(piece.choices[0].text)
    return "".join(parts)


async def test_continuous_usage_stats_is_refused(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(
            model=server.model,
            prompt="hi",
            max_tokens=2,
            stream=True,
            stream_options=options,
        )
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["param"] == "stream_options.continuous_usage_stats"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_allowed_token_ids_are_the_only_tokens_sampled(
    client: openai.AsyncOpenAI, server: RunningServer, endpoint: str
) -> None:
    tokenizer = server.engine.tokenizer
    allowed = [tokenizer.encode(letter)[0] for letter in ("x", "y")]
    assert tokenizer.decode(allowed) == "xy"
    free = await _create(client, server, endpoint, max_tokens=8, extra_body={"ignore_eos": True})
    assert set(free) - {"x", "y"}  # unconstrained, it writes other text
    for temperature in (0.0, 1.0):
        text = await _create(
            client,
            server,
            endpoint,
            max_tokens=8,
            seed=7,
            extra_body={"ignore_eos": True, "allowed_token_ids": allowed},
            **{"temperature": temperature},
        )
        assert len(text) == 8 and set(text) <= {"x", "y"}
    with pytest.raises(openai.BadRequestError) as refused:
        await _create(client, server, endpoint, max_tokens=2, extra_body={"allowed_token_ids": []})
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["param"] == "allowed_token_ids"
    assert_no_leak(server.engine)


async def test_repeated_token_ids_cost_each_step_no_more_than_each_id_once(
    client: openai.AsyncOpenAI, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body of repeats (a 2 MiB list of one id) is one id to the sampler, every step: the
    cost of a step stays within the vocabulary, whatever the request's size."""
    import asyncengine.executor.sampler as sampler

    sizes: list[int] = []

    def sized(name: str) -> Any:
        real = getattr(sampler, name)

        def record(logits: Any, rows: Any, tokens: Any) -> None:
            sizes.extend(len(list(row_tokens)) for row_tokens in tokens)
            real(logits, rows, tokens)

        return record

    monkeypatch.setattr(sampler, "keep_only_tokens", sized("keep_only_tokens"))
    monkeypatch.setattr(sampler, "ban_tokens", sized("ban_tokens"))
    x, y = (server.engine.tokenizer.encode(letter)[0] for letter in ("x", "y"))
    repeats = 100_000
    text = await _create(
        client,
        server,
        "completions",
        max_tokens=3,
        extra_body={
            "allowed_token_ids": [x, y] * repeats,
            "stop_token_ids": [2] * repeats,  # banned until min_tokens
            "min_tokens": 3,
        },
    )
    assert set(text) <= {"x", "y"}
    assert sizes and max(sizes) <= 2, max(sizes)


async def _greedy_ids(client: openai.AsyncOpenAI, server: RunningServer, **extra: Any) -> list[int]:
    """The token ids of a greedy completion of 12 tokens (its logprobs' token strings, encoded)."""
    done = await client.completions.create(
        model=server.model,
        prompt="The story goes",
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, **extra},
    )
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    ids = [server.engine.tokenizer.encode(token) for token in logprobs.tokens]
    assert all(len(one) == 1 for one in ids)
    return [one[0] for one in ids]


def _word_of(tokenizer: Any, ids: list[int]) -> bool:
    """Whether ``ids`` are how a word encodes, at the start of the text or after a space."""
    word = tokenizer.decode(ids).lstrip()
    return ids in (tokenizer.encode(word), tokenizer.encode(" " + word))


def _contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i : i + len(word)] == word for i in range(len(ids) - len(word) + 1))


async def test_bad_words_never_appear_in_the_output(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    tokenizer = server.engine.tokenizer
    free = await _greedy_ids(client, server)
    # a one-token word (banned everywhere) and a two-token one (its second token banned after
    # its first), both as the greedy output writes them
    two_at = next(i for i in range(1, len(free) - 1) if _word_of(tokenizer, free[i : i + 2]))
    for at, ids in ((0, free[:1]), (two_at, free[two_at : two_at + 2])):
        word = tokenizer.decode(ids)
        banned = await _greedy_ids(client, server, bad_words=[word])
        assert not _contains(banned, ids)
        last = at + len(ids) - 1  # where the word's last token came, now banned there
        assert banned[:last] == free[:last] and banned[last] != free[last]
    with pytest.raises(openai.BadRequestError) as refused:
        await _create(client, server, "chat", max_tokens=2, extra_body={"bad_words": [" "]})
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "bad_words"
    # bounded: tokenized as the request arrives and checked against the output every step
    for words, limit in ((["9" * 4097], "4096 characters"), (["9 " * 1500], "2048 tokens")):
        with pytest.raises(openai.BadRequestError, match=limit) as refused:
            await _create(client, server, "chat", max_tokens=2, extra_body={"bad_words": words})
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "bad_words"
    assert_no_leak(server.engine)


async def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    tokenizer = server.engine.tokenizer
    as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    chat = await client.chat.completions.create(
        model=server.model,
        messages=USER,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=as_ids,
    )
    content = chat.choices[0].logprobs and chat.choices[0].logprobs.content
    assert content and len(content) == 4
    ids = [int(entry.token.removeprefix("token_id:")) for entry in content]
    assert all(entry.token.startswith("token_id:") for entry in content)
    assert tokenizer.decode(ids) == chat.choices[0].message.content
    assert all(top.token.startswith("token_id:") for e in content for top in e.top_logprobs)
    assert bytes(b for entry in content for b in entry.bytes or []).decode() == tokenizer.decode(
        ids
    )
    done = await client.completions.create(
        model=server.model,
        prompt="The story goes",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        echo=True,
        extra_body=as_ids,
    )
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs
    prompt_ids = tokenizer.encode("The story goes")
    assert logprobs.tokens[: len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]
    generated = [int(t.removeprefix("token_id:")) for t in logprobs.tokens[len(prompt_ids) :]]
    assert "The story goes" + tokenizer.decode(generated) == done.choices[0].text
    assert all(k.startswith("token_id:") for top in logprobs.top_logprobs[1:] for k in top)
    assert_no_leak(server.engine)


PROMPT = "The story goes"


async def test_add_special_tokens_puts_the_bos_before_a_completions_prompt(
    bos_client: openai.AsyncOpenAI, bos_server: RunningServer
) -> None:
    async def echoed(**extra: Any) -> Any:
        return await bos_client.completions.create(
            model=bos_server.model,
            prompt=PROMPT,
            max_tokens=1,
            echo=True,
            logprobs=0,
            extra_body=extra,
        )

    # left out it is true, as in vLLM, SGLang and llama.cpp's server
    default, special = await echoed(), await echoed(add_special_tokens=True)
    plain = await echoed(add_special_tokens=False)
    assert default.usage and special.usage and plain.usage
    assert special.usage.prompt_tokens == plain.usage.prompt_tokens + 1
    assert default.usage.prompt_tokens == special.usage.prompt_tokens
    tokens = special.choices[0].logprobs.tokens
    assert tokens[0] == BOS and plain.choices[0].logprobs.tokens[0] != BOS
    assert default.choices[0].logprobs.tokens[:-1] == tokens[:-1]  # the prompt, BOS first
    assert special.choices[0].text.startswith(PROMPT)  # the prompt echoed as given


async def test_add_special_tokens_on_chat_and_embeddings(
    bos_client: openai.AsyncOpenAI, bos_server: RunningServer
) -> None:
    async def chat_tokens(**extra: Any) -> int:
        reply = await bos_client.chat.completions.create(
            model=bos_server.model, messages=USER, max_tokens=1, extra_body=extra
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    assert await chat_tokens(add_special_tokens=True) == await chat_tokens() + 1

    async def embedded_tokens(**extra: Any) -> int:
        done = await bos_client.embeddings.create(
            model=bos_server.model, input=PROMPT, extra_body=extra
        )
        return done.usage.prompt_tokens

    with_bos = await embedded_tokens(add_special_tokens=True)
    assert with_bos == await embedded_tokens(add_special_tokens=False) + 1
    assert await embedded_tokens() == with_bos


async def test_documents_reach_the_chat_template(
    bos_client: openai.AsyncOpenAI, bos_server: RunningServer
) -> None:
    documents = [{"title": "Moon", "text": "The moon is made of rock and dust."}]

    async def prompt_tokens(**extra: Any) -> int:
        reply = await bos_client.chat.completions.create(
            model=bos_server.model, messages=USER, max_tokens=1, extra_body=extra
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    alone = await prompt_tokens()
    with_documents = await prompt_tokens(documents=documents)
    assert with_documents > alone + 8
    assert await prompt_tokens(chat_template_kwargs={"documents": documents}) == with_documents
    with pytest.raises(openai.BadRequestError) as twice:
        await prompt_tokens(documents=documents, chat_template_kwargs={"documents": documents})
    assert isinstance(twice.value.body, dict) and twice.value.body["param"] == "documents"


async def test_the_sampling_fields_shared_with_vllm_change_the_output(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """stop_token_ids, min_tokens, repetition_penalty and skip_special_tokens, each against
    the same greedy request without it (the tiny model is deterministic)."""
    free = await _greedy_ids(client, server)

    async def text(**extra: Any) -> str:
        return await _create(
            client, server, "completions", max_tokens=12, extra_body={"ignore_eos": True, **extra}
        )

    whole = server.engine.tokenizer.decode(free)
    assert await text() == whole
    stopped = await text(stop_token_ids=[free[3]])
    assert len(stopped) < len(whole) and whole.startswith(stopped)
    # the stop token banned until 6 tokens are out: the output goes past where it stopped
    assert len(await text(stop_token_ids=[free[3]], min_tokens=6)) > len(stopped)
    assert await text(repetition_penalty=0.1) != whole  # below 1: seen tokens favoured
    special = server.engine.tokenizer.encode(BOS)
    assert await text(allowed_token_ids=special, skip_special_tokens=False) == BOS * 12
    assert await text(allowed_token_ids=special) == ""


async def test_the_python_api_checks_the_new_fields(server: RunningServer) -> None:
    with pytest.raises(InvalidRequestError) as empty:
        SamplingParams(allowed_token_ids=[])
    assert empty.value.param == "allowed_token_ids"
    with pytest.raises(InvalidRequestError) as blank:
        SamplingParams(bad_words_token_ids=[[]])
    assert blank.value.param == "bad_words_token_ids"
    vocab = server.engine.vocab_size
    for name, value in (("allowed_token_ids", [vocab]), ("bad_words_token_ids", [[1, vocab]])):
        with pytest.raises(InvalidRequestError) as outside:
            await server.engine.generate("hi", SamplingParams(max_new_tokens=2, **{name: value}))
        assert outside.value.param == name and str(vocab) in str(outside.value)
    kept = await server.engine.generate(
        "The story goes",
        SamplingParams(max_new_tokens=2, temperature=0, allowed_token_ids=[7]),
    )
    assert kept.token_ids == [7, 7]
    assert_no_leak(server.engine)
