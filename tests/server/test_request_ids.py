"""Every answer of the OpenAI and Anthropic APIs carries its request's id in ``x-request-id`` and
``request-id`` (what the official clients read as ``_request_id``), whole, streamed and refused;
a well-formed incoming ``X-Request-Id`` is that id, a malformed one is replaced; the server's log
line about a refused request names the id its client got."""

from __future__ import annotations

import logging
import re

import anthropic
import openai
import pytest

from tests.openai_server import claude, client, server  # noqa: F401  (fixtures)
from tests.server_support import RunningServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

USER = [{"role": "user", "content": "Say something."}]
FRESH_ID = re.compile(r"req_[0-9a-f]{32}")


async def test_openai_answers_carry_the_id_whole_streamed_and_refused(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    whole = await client.chat.completions.create(model=server.model, messages=USER, max_tokens=2)
    assert whole._request_id is not None and FRESH_ID.fullmatch(whole._request_id)
    answer = await client.responses.create(model=server.model, input="Hi", max_output_tokens=2)
    assert answer._request_id is not None and FRESH_ID.fullmatch(answer._request_id)

    stream = await client.chat.completions.create(
        model=server.model, messages=USER, max_tokens=2, stream=True
    )
    async with stream:
        assert FRESH_ID.fullmatch(stream.response.headers["x-request-id"])
        assert stream.response.headers["request-id"] == stream.response.headers["x-request-id"]
        _ = [chunk async for chunk in stream]

    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=server.model, messages=[], max_tokens=2)
    assert refused.value.request_id is not None and FRESH_ID.fullmatch(refused.value.request_id)
    ids = {whole._request_id, answer._request_id, refused.value.request_id}
    assert len(ids) == 3


async def test_anthropic_answers_carry_the_id_whole_streamed_and_refused(
    claude: anthropic.AsyncAnthropic, server: RunningServer
) -> None:
    message = await claude.messages.create(model=server.model, messages=USER, max_tokens=2)
    assert message._request_id is not None and FRESH_ID.fullmatch(message._request_id)
    async with claude.messages.stream(model=server.model, messages=USER, max_tokens=2) as stream:
        await stream.get_final_message()
        assert FRESH_ID.fullmatch(stream.response.headers["request-id"])
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(model=server.model, messages=[], max_tokens=2)
    assert refused.value.request_id is not None and FRESH_ID.fullmatch(refused.value.request_id)
    assert refused.value.body["request_id"] == refused.value.request_id  # type: ignore[index]


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("trace-42.a:b_C", True),
        ("x" * 128, True),
        ("x" * 129, False),  # too long
        ("a b", False),  # outside the charset
        ("", False),
    ],
)
async def test_an_incoming_id_is_kept_when_well_formed_else_replaced(
    client: openai.AsyncOpenAI, server: RunningServer, given: str, kept: bool
) -> None:
    whole = await client.chat.completions.create(
        model=server.model, messages=USER, max_tokens=1, extra_headers={"X-Request-Id": given}
    )
    assert whole._request_id == given if kept else FRESH_ID.fullmatch(whole._request_id or "")


async def test_the_refusal_log_line_names_the_id_the_client_got(
    claude: anthropic.AsyncAnthropic, server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="asyncengine.server"):
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(
                model=server.model,
                messages=[],
                max_tokens=2,
                extra_headers={"X-Request-Id": "bad id; forged"},
            )
    request_id = refused.value.request_id
    assert request_id is not None and FRESH_ID.fullmatch(request_id)
    refusals = [r.getMessage() for r in caplog.records if "refused POST" in r.getMessage()]
    assert len(refusals) == 1 and f"(request {request_id})" in refusals[0]
