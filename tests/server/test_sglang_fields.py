"""SGLang's /generate fields beyond the ones every server shares: the ones honoured change the
answer as in SGLang, and the ones not honoured are a 400 that names the field when set to
anything but SGLang's default (the default itself is accepted)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.openai_server import server  # noqa: F401  (fixtures)
from tests.server_support import RunningServer, assert_no_leak

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The story goes"

# (where, field, a value not honoured, SGLang's default): where "" is the top level
REFUSED: list[tuple[str, str, Any, Any]] = [
    ("", "input_embeds", [[0.1, 0.2]], None),
    ("", "image_data", "https://example.com/cat.png", None),
    ("", "video_data", "clip.mp4", None),
    ("", "audio_data", "clip.wav", None),
    ("", "token_ids_logprob", [1, 2], None),
    ("", "return_hidden_states", True, False),
    ("", "return_entropy", True, False),
    ("", "session_params", {"id": "s"}, None),
    ("", "custom_logit_processor", "{}", None),
    ("", "bootstrap_host", "10.0.0.1", None),
    ("", "bootstrap_room", 7, None),
    ("", "require_reasoning", True, False),
    ("", "background", True, False),
    ("sampling_params", "stop_regex", "[0-9]", None),
    ("sampling_params", "structural_tag", "{}", None),
    ("sampling_params", "custom_params", {"a": 1}, None),
]


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def generate(
    http: aiohttp.ClientSession, server: RunningServer, top: dict[str, Any], **sampling: Any
) -> tuple[int, Any]:
    body = {
        "text": PROMPT,
        **top,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, **sampling},
    }
    async with http.post(server.base_url + "/generate", json=body) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize(("where", "name", "value", "default"), REFUSED)
async def test_a_field_not_honoured_is_a_400_naming_it(
    http: aiohttp.ClientSession,
    server: RunningServer,
    where: str,
    name: str,
    value: Any,
    default: Any,
) -> None:
    def sent(given: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return ({}, {name: given}) if where else ({name: given}, {})

    top, sampling = sent(value)
    status, body = await generate(http, server, top, **sampling)
    param = f"{where}.{name}" if where else name
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["code"] == "unsupported_parameter"
    assert param in body["error"]["message"]
    top, sampling = sent(default)
    status, body = await generate(http, server, top, **sampling)
    assert status == 200, body
    assert_no_leak(server.engine)


async def test_spaces_between_special_tokens_false_is_refused_only_with_special_tokens_shown(
    http: aiohttp.ClientSession, server: RunningServer
) -> None:
    off = {"spaces_between_special_tokens": False}
    status, body = await generate(http, server, {}, skip_special_tokens=False, **off)
    assert (
        status == 400 and body["error"]["param"] == "sampling_params.spaces_between_special_tokens"
    )
    status, _ = await generate(http, server, {}, **off)
    assert status == 200


async def test_no_stop_trim_ends_the_text_with_the_stop_string(
    http: aiohttp.ClientSession, server: RunningServer
) -> None:
    _, whole = await generate(http, server, {})
    text = whole["text"]
    stop = next(
        text[i : i + 3]
        for i in range(len(text) // 3, len(text) - 3)
        if text[i : i + 3].strip() == text[i : i + 3]
    )
    end = text.index(stop) + len(stop)
    _, trimmed = await generate(http, server, {}, stop=stop)
    assert trimmed["text"] == text[: end - len(stop)]
    _, kept = await generate(http, server, {}, stop=stop, no_stop_trim=True)
    assert kept["text"] == text[:end]


async def test_logit_bias_moves_the_tokens(
    http: aiohttp.ClientSession, server: RunningServer
) -> None:
    _, free = await generate(http, server, {})
    first = free["output_ids"][0]
    _, banned = await generate(http, server, {}, logit_bias={str(first): -100})
    assert first not in banned["output_ids"]
    favourite = free["output_ids"][-1] + 1
    _, favoured = await generate(http, server, {}, logit_bias={str(favourite): 100})
    assert favoured["output_ids"] == [favourite] * 12
    status, body = await generate(http, server, {}, logit_bias={"x": 1})
    assert status == 400 and body["error"]["param"] == "sampling_params.logit_bias"
    assert_no_leak(server.engine)
