"""Logprobs of text whose characters span several tokens (CJK, emoji: byte-level BPE splits them
into byte pieces), over loopback with the openai client: a chat reply's tokens' ``bytes`` join
to its UTF-8, and /v1/completions' ``text_offset`` gives each token's start in the returned
text (echoed prompt, then the completion), streamed or not."""

from __future__ import annotations

import openai
import pytest

from asyncengine.common.sampling_params import SamplingParams, StructuredOutput
from tests.openai_server import client, server  # noqa: F401  (fixtures)
from tests.server_support import RunningServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

# the output is held to this text, so the random tiny model writes it whatever it picks: 日 and
# 🎉 are no single token of the embedded tokenizer, so some of its tokens are pieces of one
PIECES = "🎉 日本語 ok"
PROMPT = "日本語 🎉"
REPLY_TOKENS = 24  # ample: the reply ends (EOS) once the text is written


def special_texts(server: RunningServer) -> set[str]:
    """The special tokens' texts: a reply's EOS is scored but no part of its text."""
    tokenizer = server.engine.tokenizer
    return {tokenizer.decode([t], skip_special_tokens=False) for t in tokenizer.all_special_ids}


def is_piece(data: bytes) -> bool:
    """Bytes that are no whole UTF-8 text: a piece of a character."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


async def test_chat_logprob_bytes_join_to_the_reply(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    resp = await client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Celebrate."}],
        max_tokens=REPLY_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"regex": PIECES},
    )
    choice = resp.choices[0]
    assert choice.message.content == PIECES
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    specials = special_texts(server)
    pieces = [bytes(e.bytes or []) for e in entries if e.token not in specials]
    assert b"".join(pieces) == PIECES.encode()
    assert any(is_piece(p) for p in pieces), "no token was a piece of a character"
    for entry in entries:
        for scored in [entry, *entry.top_logprobs]:
            # the token's text is its bytes decoded alone (a piece of a character: U+FFFD)
            assert scored.bytes is not None
            assert scored.token == bytes(scored.bytes).decode("utf-8", "replace")


def expected_offsets(server: RunningServer, ids: list[int], start: int = 0) -> list[int]:
    """Each token's start: the characters the tokens before it decode to, an incomplete last
    character not counted."""
    tokenizer = server.engine.tokenizer
    return [start + len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]


def assert_offsets_in_text(
    server: RunningServer, offsets: list[int], tokens: list[str], text: str
) -> None:
    assert offsets == sorted(offsets)
    assert all(0 <= offset <= len(text) for offset in offsets)
    specials = special_texts(server)
    for offset, token in zip(offsets, tokens, strict=True):
        # a token of whole characters is found where it starts
        if "\ufffd" not in token and token not in specials:
            assert text[offset : offset + len(token)] == token


async def completion(
    client: openai.AsyncOpenAI, server: RunningServer, stream: bool, echo: bool
) -> tuple[str, list[str], list[int]]:
    """The text, tokens and text offsets of PROMPT's completion held to PIECES."""
    kwargs = {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": REPLY_TOKENS,
        "temperature": 0,
        "logprobs": 0,
        "echo": echo,
        "extra_body": {"regex": PIECES},
    }
    if not stream:
        out = await client.completions.create(**kwargs)
        (choice,) = out.choices
        assert choice.logprobs is not None
        logprobs = choice.logprobs
        return choice.text, logprobs.tokens or [], logprobs.text_offset or []
    text, tokens, offsets = "", [], []
    async for chunk in await client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                offsets += choice.logprobs.text_offset or []
    return text, tokens, offsets


async def reply_ids(server: RunningServer) -> list[int]:
    """The tokens the completion generates (the same greedy run through the engine)."""
    reply = await server.engine.generate(
        server.engine.tokenize(PROMPT),
        SamplingParams(
            max_new_tokens=REPLY_TOKENS,
            temperature=0,
            structured=StructuredOutput("regex", PIECES),
        ),
    )
    assert reply.text == PIECES
    return reply.token_ids


@pytest.mark.parametrize("stream", [False, True])
async def test_text_offsets_of_echoed_multibyte_prompt_and_completion(
    client: openai.AsyncOpenAI, server: RunningServer, stream: bool
) -> None:
    text, tokens, offsets = await completion(client, server, stream, echo=True)
    assert text == PROMPT + PIECES
    prompt_ids = server.engine.tokenize(PROMPT)
    generated = await reply_ids(server)
    assert len(offsets) == len(tokens) == len(prompt_ids) + len(generated)
    assert offsets[: len(prompt_ids)] == expected_offsets(server, prompt_ids)
    # the completion's tokens go on from the end of the prompt's text
    assert offsets[len(prompt_ids) :] == expected_offsets(server, generated, len(PROMPT))
    assert_offsets_in_text(server, offsets, tokens, text)


@pytest.mark.parametrize("stream", [False, True])
async def test_text_offsets_without_echo_start_at_the_completion(
    client: openai.AsyncOpenAI, server: RunningServer, stream: bool
) -> None:
    text, tokens, offsets = await completion(client, server, stream, echo=False)
    assert text == PIECES
    assert offsets == expected_offsets(server, await reply_ids(server))
    assert_offsets_in_text(server, offsets, tokens, text)
