"""vLLM's extra request fields, sent as the openai client sends them (``extra_body``): the ones
honoured change the answer as in vLLM."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.openai_server import client, server  # noqa: F401  (fixtures)
from tests.server_support import RunningServer, assert_no_leak

pytestmark = pytest.mark.asyncio(loop_scope="module")

USER = [{"role": "user", "content": "hi"}]


async def _create(
    client: openai.AsyncOpenAI, server: RunningServer, endpoint: str, **kwargs: Any
) -> str:
    """The first choice's text of a greedy request."""
    common: dict[str, Any] = {"model": server.model, "temperature": 0, **kwargs}
    if endpoint == "chat":
        chat = await client.chat.completions.create(messages=USER, **common)  # type: ignore[arg-type]
        return chat.choices[0].message.content or ""
    done = await client.completions.create(prompt="The story goes", **common)
    return done.choices[0].text


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
        chunks = await client.chat.completions.create(messages=USER, **common)  # type: ignore[arg-type]
        async for chunk in chunks:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
    else:
        pieces = await client.completions.create(prompt="The story goes", **common)
        async for piece in pieces:
            if piece.choices:
                parts.append(piece.choices[0].text)
    return "".join(parts)
