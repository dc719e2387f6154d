"""scripts/agent_loop.py against a live server on loopback: the Anthropic SDK and the OpenAI
SDK's Responses API each drive the tool for a round and then get an answer."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.openai_server import server  # noqa: F401  (fixture)
from tests.scripts.test_bench_scripts import load_script
from tests.server_support import RunningServer

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.mark.parametrize("api", ["anthropic", "responses"])
@pytest.mark.parametrize("stream", [False, True])
async def test_the_agent_loop_calls_the_tool_then_answers(
    server: RunningServer, api: str, stream: bool
) -> None:
    script = load_script("agent_loop")
    loop = script.anthropic_loop if api == "anthropic" else script.responses_loop
    model = await asyncio.to_thread(script.served_model, server.base_url, "unused")
    assert model == server.model
    transcript = await asyncio.to_thread(
        loop,
        server.base_url,
        "unused",
        model,
        "What is the weather in Paris?",
        max_rounds=3,
        first_tool_choice="required",
        max_tokens=60,
        stream=stream,
    )
    kinds = [kind for kind, _ in transcript.steps]
    assert kinds[0] == "call" and kinds[-1] == "answer", transcript.steps
    assert kinds.count("call") == kinds.count("result") >= 1
    for kind, text in transcript.steps:
        if kind == "call":
            assert text.startswith("get_weather(")
        elif kind == "result":
            assert json.loads(text)["city"] in {"Paris", "Oslo", "Lima"}
