"""Top-level fields a request type does not read are accepted and named in one bounded warning
line per request: unit checks on every OpenAI request type, then over HTTP on the tiny model."""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import msgspec
import pytest

from asyncengine.server.embeddings import EmbeddingRequest
from asyncengine.server.openai_schema import ChatCompletionRequest, CompletionRequest
from asyncengine.server.responses_schema import ResponsesRequest
from asyncengine.server.unknown_fields import (
    MAX_FIELD_NAME_CHARS,
    MAX_NAMED_FIELDS,
    ignored_fields_message,
    unknown_fields,
)
from tests.openai_server import server  # noqa: F401  (fixture)
from tests.server_support import RunningServer

IGNORED = "the following fields were present in the request but ignored"


def _body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize(
    ("request_type", "body"),
    [
        (ChatCompletionRequest, _body(messages=[], max_token=3, temprature=0.5)),
        (CompletionRequest, _body(prompt="x", max_token=3, temprature=0.5)),
        (EmbeddingRequest, _body(input="x", max_token=3, temprature=0.5)),
        (ResponsesRequest, _body(input="x", max_token=3, temprature=0.5)),
    ],
    ids=["chat", "completions", "embeddings", "responses"],
)
def test_misspelt_fields_are_found_on_every_openai_route(
    request_type: type[msgspec.Struct], body: bytes
) -> None:
    assert unknown_fields(body, request_type) == ["max_token", "temprature"]


def test_known_fields_and_their_encoded_names_are_not_reported() -> None:
    body = _body(
        messages=[],
        max_tokens=3,
        temperature=0.5,
        response_format={"type": "json_schema", "json_schema": {"schema": {}, "bogus": 1}},
    )
    assert unknown_fields(body, ChatCompletionRequest) == []  # nested keys are not top level


def test_the_line_stays_bounded_for_ten_thousand_unknown_keys() -> None:
    keys = {f"{'k' * 500}{i}": "v" * 1000 for i in range(10_000)}
    body = json.dumps({"prompt": "x", **keys}).encode()
    names = unknown_fields(body, CompletionRequest)
    assert len(names) == 10_000
    line = ignored_fields_message("/v1/completions", names)
    assert len(line) < 200 + MAX_NAMED_FIELDS * (MAX_FIELD_NAME_CHARS + 10)
    assert "and 9995 more" in line
    assert "v" * 10 not in line  # nothing from the values


def test_a_control_character_in_a_name_is_escaped() -> None:
    line = ignored_fields_message("/v1/completions", ["a\nb\x1b"])
    assert "\n" not in line and "\x1b" not in line
    assert "a\\nb\\x1b" in line


@pytest.mark.asyncio(loop_scope="module")
async def test_a_misspelt_field_is_served_and_named_in_one_warning(
    server: RunningServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncengine.server")
    body = {"prompt": "hello", "max_tokens": 1, "max_token": 5, "temprature": 0.1}
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
    lines = [r.getMessage() for r in caplog.records if IGNORED in r.getMessage()]
    assert len(lines) == 1, lines
    assert "'max_token'" in lines[0] and "'temprature'" in lines[0]
    assert "/v1/completions" in lines[0]
