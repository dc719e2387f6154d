"""A grammar the compiler refuses (a dangling ``$ref``, a bad pattern) is a 400 that names the
field it came from, whichever route and field gave it, over HTTP on the tiny model."""

from __future__ import annotations

from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from tests.openai_server import claude, client, server  # noqa: F401  (fixtures)
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


async def test_a_bound_that_breaks_json_schemas_rules_is_a_400_naming_it(
    server: RunningServer, client: openai.AsyncOpenAI, claude: anthropic.AsyncAnthropic
) -> None:
    """xgrammar refuses ``minLength: -1`` in words of its own (its grammar's repetition range)
    and reads ``maxItems: -1`` as no bound: both are a 400 naming the field and the rule."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": -1}}}
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model=server.model,
            messages=USER,  # type: ignore[arg-type]
            max_tokens=2,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "response_format.json_schema.schema"
    assert error["message"] == (
        "invalid JSON schema: 'minLength' at #/properties/a must be a non-negative integer "
        "(at most 2147483647), not -1"
    )
    listed = {"type": "object", "properties": {"b": {"type": "array", "maxItems": -1}}}
    with pytest.raises(anthropic.BadRequestError) as refused_too:
        await claude.messages.create(
            model=server.model,
            max_tokens=2,
            messages=USER,  # type: ignore[arg-type]
            tools=[
                {"name": "one", "input_schema": OBJECT},
                {"name": "two", "input_schema": OBJECT},
                {"name": "listed", "input_schema": listed},
            ],
            tool_choice={"type": "any"},
        )
    message = refused_too.value.body["error"]["message"]  # type: ignore[index]
    assert message == (
        "tools[2].input_schema: invalid JSON schema: 'maxItems' at #/properties/b must be a "
        "non-negative integer (at most 2147483647), not -1"
    )
