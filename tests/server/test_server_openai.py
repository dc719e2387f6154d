"""The OpenAI-compatible endpoints driven by the official `openai` client over loopback."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from asyncengine.api.intake import Intake
from asyncengine.common.config import EngineConfig
from asyncengine.common.outputs import Usage
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.server.echo import sum_usage
from asyncengine.server.errors import from_engine_error
from asyncengine.server.openai_schema import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_max_tokens,
    chat_sampling_params,
    completion_sampling_params,
    decode_body,
)
from tests.openai_server import client, server  # noqa: F401  (fixtures)
from tests.server_support import (
    MAX_MODEL_LEN,
    RunningServer,
    assert_no_leak,
    engine_idle,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Explain paged attention in one sentence."},
]
PROMPT = "The radix tree shares prefixes between requests, so"


def greedy(max_new_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **kw)


def ascii_stop(text: str) -> tuple[str, int]:
    """A 3-character ASCII stop string from the middle of ``text`` and where it first occurs."""
    for start in range(len(text) // 3, len(text) - 3):
        candidate = text[start : start + 3]
        if candidate.isascii() and candidate.strip():
            return candidate, text.find(candidate)
    raise AssertionError(f"no ASCII stop candidate in {text!r}")


async def test_models_lists_the_served_model(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [server.model]
    one = await client.models.retrieve(server.model)
    assert one.id == server.model


async def test_chat_equals_engine_generate(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    expected = await server.engine.generate(CHAT, greedy(12))
    resp = await client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == "length" == expected.finish_reason
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == expected.usage.prompt_tokens
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == expected.usage.prompt_tokens + 12
    # The engine's own request left the prefix in the cache; the HTTP one reused it.
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens > 0


async def test_max_completion_tokens_wins(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    resp = await client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    assert resp.choices[0].finish_reason == "length"


async def test_an_assistant_refusal_part_is_read_as_its_text(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """OpenAI's API takes refusal parts in an assistant's content; the prompt holds their
    text where a text part would."""
    refusal = "I cannot help with that."
    answers = []
    for content in (
        refusal,
        [{"type": "refusal", "refusal": refusal}],
        [{"type": "text", "text": refusal}],
    ):
        history: Any = [*CHAT, {"role": "assistant", "content": content}, CHAT[1]]
        resp = await client.chat.completions.create(
            model=server.model, messages=history, max_tokens=4, temperature=0
        )
        assert resp.usage is not None
        answers.append((resp.usage.prompt_tokens, resp.choices[0].message.content))
    assert answers[1] == answers[0] and answers[2] == answers[0]


async def test_completion_equals_engine_generate(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    expected = await server.engine.generate(PROMPT, greedy(10))
    resp = await client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(server.engine.tokenizer.encode(PROMPT))
    assert resp.usage.completion_tokens == 10


async def test_completion_accepts_token_ids(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    ids = server.engine.tokenizer.encode(PROMPT)
    by_text = await client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=6, temperature=0
    )
    by_ids = await client.completions.create(
        model=server.model, prompt=ids, max_tokens=6, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text


async def test_chat_stream_matches_non_stream(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    full = await client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    stream = await client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert all(c.id == chunks[0].id for c in chunks)
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    assert usage_chunks[0].usage.completion_tokens == 16
    assert usage_chunks[0].usage.prompt_tokens == full.usage.prompt_tokens  # type: ignore[union-attr]


async def test_completion_stream_without_usage(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    full = await client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=8, temperature=0
    )
    stream = await client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)


async def test_batched_prompts_usage_is_the_same_streamed_and_whole(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    # the second prompt is longer than a page: once cached, its cached tokens show in the sum
    prompts = ["x", PROMPT + " " + PROMPT]
    kwargs: dict[str, Any] = dict(
        model=server.model,
        prompt=prompts,
        n=2,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    await client.completions.create(**kwargs)  # the later two find both prompts cached
    stream = await client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    streamed = [c.usage async for c in stream if c.usage is not None]
    whole = (await client.completions.create(**kwargs)).usage
    assert whole is not None and len(streamed) == 1
    lengths = [len(server.engine.tokenizer.encode(p)) for p in prompts]
    assert whole.prompt_tokens == sum(lengths)  # each prompt once, not once per choice
    assert whole.completion_tokens == len(prompts) * 2 * 3
    assert whole.prompt_tokens_details is not None
    assert whole.prompt_tokens_details.cached_tokens >= 16  # the long prompt's first page
    assert streamed[0].model_dump() == whole.model_dump()


async def test_a_batch_usage_adds_up_every_count() -> None:
    total = sum_usage([Usage(1, 2, 3, 4), Usage(10, 20, 30, 40)])
    assert total == Usage(11, 22, 33, 44)


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_is_honoured(
    client: openai.AsyncOpenAI, server: RunningServer, stream: bool
) -> None:
    base = await server.engine.generate(PROMPT, greedy(24))
    stop, at = ascii_stop(base.text)
    kwargs = {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "stop": [stop],
    }
    if stream:
        chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        resp = await client.completions.create(**kwargs)
        text, finish = resp.choices[0].text, resp.choices[0].finish_reason
    assert text == base.text[:at]
    assert finish == "stop"


# Every sampling knob of the issue, each away from its default; top_k and min_p are not in the
# openai client's signature, which sends them through extra_body. On the tiny model temperature,
# top_p, top_k and seed each change this sampled output (its outputs never repeat a token, so
# the penalties and this min_p do not): the mapping test below covers the rest field by field.
OPENAI_KNOBS = {
    "temperature": 2.0,
    "top_p": 0.9,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.3,
    "seed": 77,
}
EXTRA_KNOBS = {"top_k": 50, "min_p": 0.01}
KNOBS = {**OPENAI_KNOBS, **EXTRA_KNOBS}


async def test_request_fields_map_onto_sampling_params() -> None:
    body = {"messages": CHAT, "max_tokens": 9, "stop": "END", "logprobs": True, "top_logprobs": 2}
    chat_req = decode_body(json.dumps({**body, **KNOBS}).encode(), ChatCompletionRequest)
    requested, param = chat_max_tokens(chat_req)
    assert (requested, param) == (9, "max_tokens")
    limits = Intake(None, 1000, 512, EngineConfig())
    params = chat_sampling_params(chat_req, limits.max_new_tokens(requested, 100, 20, param))
    for name, value in KNOBS.items():
        assert getattr(params, name) == value, name
    assert params.max_new_tokens == 9 and params.stop == ["END"]
    assert params.logprobs and params.top_logprobs == 2
    body = {"prompt": PROMPT, "stop": ["a", "b"], "logprobs": 3, **KNOBS}
    text_req = decode_body(json.dumps(body).encode(), CompletionRequest)
    max_tokens = limits.max_new_tokens(text_req.max_tokens, 16, 20, "max_tokens")
    params = completion_sampling_params(text_req, max_tokens)
    for name, value in KNOBS.items():
        assert getattr(params, name) == value, name
    assert params.max_new_tokens == 16 and params.stop == ["a", "b"]
    assert params.logprobs and params.top_logprobs == 3
    # max_tokens beyond the context is refused with the numbers (as vLLM does), not clamped
    huge = decode_body(json.dumps({"prompt": "x", "max_tokens": 10**9}).encode(), CompletionRequest)
    with pytest.raises(InvalidRequestError) as info:
        limits.max_new_tokens(huge.max_tokens, 16, 20, "max_tokens")
    error = from_engine_error(info.value)
    assert error.status == 400 and error.param == "max_tokens"
    assert "512" in error.message and str(20 + 10**9) in error.message


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_sampled_request_equals_engine_generate(
    client: openai.AsyncOpenAI, server: RunningServer, endpoint: str
) -> None:
    """Sampling with every knob set and a seed gives what engine.generate gives for the same
    SamplingParams: the server passes each knob on unchanged."""
    prompt = CHAT if endpoint == "chat" else PROMPT
    expected = await server.engine.generate(
        prompt, SamplingParams(max_new_tokens=12, ignore_eos=True, **KNOBS)
    )
    kwargs = {
        "model": server.model,
        "max_tokens": 12,
        "extra_body": {"ignore_eos": True, **EXTRA_KNOBS},
        **OPENAI_KNOBS,
    }
    if endpoint == "chat":
        resp = await client.chat.completions.create(messages=CHAT, **kwargs)
        text = resp.choices[0].message.content
    else:
        resp = await client.completions.create(prompt=PROMPT, **kwargs)
        text = resp.choices[0].text
    assert text == expected.text
    assert resp.usage is not None and resp.usage.completion_tokens == 12


@pytest.mark.parametrize("seed", [1234, -1, -(2**63)])
async def test_seeded_sampling_is_reproducible(
    client: openai.AsyncOpenAI, server: RunningServer, seed: int
) -> None:
    kwargs = {
        "model": server.model,
        "messages": CHAT,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": seed,
    }
    first = await client.chat.completions.create(**kwargs)
    second = await client.chat.completions.create(**kwargs)
    assert first.choices[0].message.content == second.choices[0].message.content


async def test_chat_logprobs(client: openai.AsyncOpenAI, server: RunningServer) -> None:
    resp = await client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = resp.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 5
    for entry in logprobs.content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)
        assert entry.token == entry.top_logprobs[0].token


async def test_completion_logprobs(client: openai.AsyncOpenAI, server: RunningServer) -> None:
    resp = await client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = resp.choices[0].logprobs
    assert logprobs is not None
    assert len(logprobs.tokens or []) == len(logprobs.token_logprobs or []) == 4
    assert all(lp <= 0 for lp in logprobs.token_logprobs or [])
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs or [])
    assert logprobs.text_offset == sorted(logprobs.text_offset or [])


async def test_unknown_model_is_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"
    assert "gpt-4o" in info.value.message


async def test_n_above_max_n_is_refused(client: openai.AsyncOpenAI, server: RunningServer) -> None:
    n = server.engine.config.max_n + 1
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2, n=n)
    assert info.value.param == "n"
    assert f"n={n}" in info.value.message


async def test_chat_without_max_tokens_runs_to_the_context(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    out = await client.chat.completions.create(
        model=server.model, messages=CHAT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None
    assert out.usage.prompt_tokens + out.usage.completion_tokens == MAX_MODEL_LEN
    assert out.choices[0].finish_reason == "length"


async def test_a_completion_without_max_tokens_generates_the_default(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """Unlike chat, a text completion stops at OpenAI's default (docs/serving.md says so)."""
    out = await client.completions.create(
        model=server.model, prompt="Hi", temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None
    assert out.usage.completion_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert out.choices[0].finish_reason == "length"


async def test_nothing_leaks_after_the_module(server: RunningServer) -> None:
    assert await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)
