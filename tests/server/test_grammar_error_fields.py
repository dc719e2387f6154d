"""A grammar the compiler refuses (a dangling ``$ref``, a bad pattern) is a 400 that names the
field it came from, whichever route and field gave it, over HTTP on the tiny model."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.openai_server import server  # noqa: F401  (fixture)
from tests.server_support import RunningServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

DANGLING = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/missing"}},
    "required": ["a"],
}
USER = [{"role": "user", "content": "hi"}]
OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


CASES: list[tuple[str, str, dict[str, Any], str]] = [
    (
        "completions json_schema",
        "/v1/completions",
        {
            "prompt": "hi",
            "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"schema": DANGLING}},
        },
        "response_format.json_schema.schema",
    ),
    (
        "chat regex",
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 2, "regex": "[a-"},
        "regex",
    ),
    (
        "completions ebnf",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "ebnf": "root ::= missing_rule"},
        "ebnf",
    ),
    (
        "chat tool parameters",
        "/v1/chat/completions",
        {
            "messages": USER,
            "max_tokens": 2,
            "tools": [_tool("plain"), _tool("broken", DANGLING)],
            "tool_choice": "required",
        },
        "tools[1].function.parameters",
    ),
    (
        "chat tool parameters, one of several held",
        "/v1/chat/completions",
        {
            "messages": USER,
            "max_tokens": 2,
            "tools": [_tool("one", OBJECT), _tool("two", OBJECT), _tool("broken", DANGLING)],
            "tool_choice": "required",
        },
        "tools[2].function.parameters",
    ),
    (
        "chat answer schema beside held tools",
        "/v1/chat/completions",
        {
            "messages": USER,
            "max_tokens": 2,
            "tools": [_tool("one", OBJECT), _tool("two", OBJECT)],
            "response_format": {"type": "json_schema", "json_schema": {"schema": DANGLING}},
        },
        "response_format.json_schema.schema",
    ),
    (
        "responses tool parameters, one of several",
        "/v1/responses",
        {
            "input": "hi",
            "max_output_tokens": 2,
            "store": False,
            "tools": [
                {"type": "function", "name": "one", "parameters": OBJECT},
                {"type": "function", "name": "broken", "parameters": DANGLING},
            ],
            "tool_choice": "required",
        },
        "tools[1].parameters",
    ),
    (
        "native regex",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "regex": "[a-"}},
        "sampling_params.regex",
    ),
    (
        "responses text.format",
        "/v1/responses",
        {
            "input": "hi",
            "max_output_tokens": 2,
            "store": False,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": DANGLING}},
        },
        "text.format.schema",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
async def test_a_grammar_that_does_not_compile_names_its_field(
    server: RunningServer, path: str, body: dict[str, Any], param: str
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(server.base_url + path, json=body) as response:
            status, answer = response.status, await response.json()
    assert status == 400, answer
    error = answer["error"] if "error" in answer else answer
    assert error["param"] == param, error

