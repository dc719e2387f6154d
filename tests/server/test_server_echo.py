"""``echo`` + ``logprobs`` on /v1/completions through the openai client, in the shape
lm-evaluation-harness's local-completions reads (prompt token logprobs, the first null, then
the generated token's), token-id, text and batched prompts, n, streamed and not, max_tokens 0;
and SGLang's ``return_logprob`` + ``logprob_start_len`` on /generate."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio

from tests.hf_scorer import HFScorer, hf, model_dir  # noqa: F401  (fixtures)
from tests.server_support import (
    MAX_MODEL_LEN,
    RunningServer,
    assert_no_leak,
    engine_config,
    engine_idle,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
TOLERANCE = 1e-4
TEXT = "The radix tree shares prefixes between requests, so a scored prompt"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(model_dir: Path) -> AsyncIterator[RunningServer]:
    # 32-token chunks: the longer prompts are scored over several steps
    config = engine_config(model_dir, chunked_prefill_size=32, max_prefill_tokens=32)
    running = await start_server(config)
    yield running
    await running.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0
    ) as c:
        yield c


def token_prompts(server: RunningServer) -> list[list[int]]:
    ids = server.engine.tokenize(TEXT * 3)
    return [ids[:5], ids[:40], ids[7:60]]


def assert_scored_like_hf(hf: HFScorer, prompt: list[int], logprobs: object, k: int) -> None:
    token_logprobs = logprobs.token_logprobs  # type: ignore[attr-defined]
    top_logprobs = logprobs.top_logprobs  # type: ignore[attr-defined]
    assert token_logprobs[0] is None and top_logprobs[0] is None
    reference = hf.logprobs(prompt)
    for position in range(1, len(prompt)):
        row = reference[position - 1]
        assert abs(token_logprobs[position] - float(row[prompt[position]])) < TOLERANCE
        assert len(top_logprobs[position]) == k
        best = sorted(top_logprobs[position].values(), reverse=True)
        for value, expected in zip(best, row.topk(k).values.tolist(), strict=True):
            assert abs(value - expected) < TOLERANCE


async def test_lm_eval_request_shape(
    client: openai.AsyncOpenAI, server: RunningServer, hf: HFScorer
) -> None:
    """What lm-eval 0.4.x sends per choice: token ids, echo, logprobs 1, one greedy token."""
    prompts = token_prompts(server)
    out = await client.completions.create(
        model=server.model,
        prompt=prompts,
        max_tokens=1,
        temperature=0,
        logprobs=1,
        echo=True,
        seed=1234,
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, out.choices, strict=True):
        lp = choice.logprobs
        assert lp is not None
        # every prompt token, then exactly the one generated token
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 1
        assert_scored_like_hf(hf, prompt, lp, 1)
        generated = lp.top_logprobs[-1]
        assert lp.token_logprobs[-1] == max(generated.values())  # greedy: the top value, exactly
        assert choice.text.startswith(server.engine.tokenizer.decode(prompt))
        assert lp.text_offset == sorted(lp.text_offset)
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert out.usage.completion_tokens == 3
    await wait_until(lambda: engine_idle(server.engine))
    assert_no_leak(server.engine)


async def test_greedy_continuation_reads_as_greedy(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    """lm-eval's is_greedy: each continuation token's logprob equals its top value exactly."""
    context = token_prompts(server)[1]
    greedy = await client.completions.create(
        model=server.model, prompt=context, max_tokens=6, temperature=0
    )
    continuation = server.engine.tokenize(greedy.choices[0].text)
    scored = await client.completions.create(
        model=server.model,
        prompt=context + continuation,
        max_tokens=1,
        temperature=0,
        logprobs=1,
        echo=True,
    )
    lp = scored.choices[0].logprobs
    assert lp is not None
    tail = slice(len(context), -1)
    for token_logprob, top in zip(lp.token_logprobs[tail], lp.top_logprobs[tail], strict=True):
        assert token_logprob == max(top.values())


async def test_text_prompt_scored_with_max_tokens_zero(
    client: openai.AsyncOpenAI, server: RunningServer, hf: HFScorer
) -> None:
    out = await client.completions.create(
        model=server.model, prompt=TEXT, max_tokens=0, logprobs=3, echo=True
    )
    (choice,) = out.choices
    assert choice.text == TEXT
    assert choice.finish_reason == "length"
    prompt = server.engine.tokenize(TEXT)
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == len(prompt)
    assert "".join(choice.logprobs.tokens) == TEXT
    assert_scored_like_hf(hf, prompt, choice.logprobs, 3)
    assert out.usage.completion_tokens == 0


async def test_a_whole_context_prompt_is_scored_but_not_continued(
    client: openai.AsyncOpenAI, server: RunningServer, hf: HFScorer
) -> None:
    prompt = (server.engine.tokenize(TEXT) * MAX_MODEL_LEN)[:MAX_MODEL_LEN]
    out = await client.completions.create(
        model=server.model, prompt=prompt, max_tokens=0, logprobs=1, echo=True
    )
    (choice,) = out.choices
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == MAX_MODEL_LEN
    assert_scored_like_hf(hf, prompt, choice.logprobs, 1)
    with pytest.raises(openai.BadRequestError, match="no room to generate"):
        await client.completions.create(model=server.model, prompt=prompt, max_tokens=1)


async def test_echo_without_logprobs_only_echoes(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    out = await client.completions.create(
        model=server.model, prompt=[TEXT, "Another prompt"], max_tokens=3, temperature=0, echo=True
    )
    assert [
        c.text[: len(p)] for c, p in zip(out.choices, [TEXT, "Another prompt"], strict=True)
    ] == [
        TEXT,
        "Another prompt",
    ]
    assert all(c.logprobs is None for c in out.choices)


async def test_batched_prompts_with_n(client: openai.AsyncOpenAI, server: RunningServer) -> None:
    prompts = ["First prompt here", "A second, longer prompt than the first one"]
    out = await client.completions.create(
        model=server.model,
        prompt=prompts,
        n=2,
        max_tokens=2,
        temperature=1.0,
        seed=3,
        logprobs=0,
        echo=True,
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice in out.choices:
        prompt = prompts[choice.index // 2]
        assert choice.text.startswith(prompt)
        assert choice.logprobs is not None
        assert len(choice.logprobs.tokens) == len(server.engine.tokenize(prompt)) + 2
    # a prompt's choices share its scores
    assert (
        out.choices[0].logprobs.token_logprobs[:-2] == out.choices[1].logprobs.token_logprobs[:-2]
    )
    assert out.usage.completion_tokens == 8


async def test_streamed_echo_equals_the_whole_response(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    prompts = token_prompts(server)[1:]
    kwargs = {"model": server.model, "prompt": prompts, "max_tokens": 4, "temperature": 0}
    whole = await client.completions.create(**kwargs, logprobs=2, echo=True)
    texts = ["", ""]
    token_logprobs: list[list[float | None]] = [[], []]
    stream = await client.completions.create(**kwargs, logprobs=2, echo=True, stream=True)
    first_chunks: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            first_chunks.setdefault(choice.index, choice.text)
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                token_logprobs[choice.index] += choice.logprobs.token_logprobs
    for i, choice in enumerate(whole.choices):
        assert texts[i] == choice.text
        assert first_chunks[i] == server.engine.tokenizer.decode(prompts[i])
        assert token_logprobs[i] == pytest.approx(choice.logprobs.token_logprobs)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),  # generates nothing and scores nothing
        ({"echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": ["ok", [1, -2]]}, "prompt"),
        ({"prompt": ["x"] * 1025}, "prompt"),
    ],
)
async def test_bad_combinations_are_400(
    server: RunningServer, body: dict[str, object], param: str
) -> None:
    async with aiohttp.ClientSession() as http:
        payload = {"model": server.model, "prompt": "hi", "max_tokens": 1, **body}
        async with http.post(server.base_url + "/v1/completions", json=payload) as response:
            assert response.status == 400
            error = (await response.json())["error"]
    assert error["param"] == param


async def test_native_generate_scores_input_tokens(server: RunningServer, hf: HFScorer) -> None:
    ids = token_prompts(server)[2]
    async with aiohttp.ClientSession() as http:
        payload = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        }
        async with http.post(server.base_url + "/generate", json=payload) as response:
            assert response.status == 200
            whole = (await response.json())["meta_info"]
        payload.update(logprob_start_len=10, sampling_params={"max_new_tokens": 2})
        async with http.post(server.base_url + "/generate", json=payload) as response:
            assert response.status == 200
            later = (await response.json())["meta_info"]
        payload.update(return_logprob=False)
        async with http.post(server.base_url + "/generate", json=payload) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "logprob_start_len"
    entries = whole["input_token_logprobs"]
    assert [token for _, token, _ in entries] == ids
    assert entries[0][0] is None and whole["input_top_logprobs"][0] is None
    reference = hf.logprobs(ids)
    for position in range(1, len(ids)):
        assert abs(entries[position][0] - float(reference[position - 1, ids[position]])) < TOLERANCE
        assert len(whole["input_top_logprobs"][position]) == 2
    assert whole["output_token_logprobs"] == [] and whole["completion_tokens"] == 0
    later_entries = later["input_token_logprobs"]
    assert [token for _, token, _ in later_entries] == ids[10:]
    assert [v for v, _, _ in later_entries] == pytest.approx([v for v, _, _ in entries[10:]])
    assert len(later["output_token_logprobs"]) == 2
