"""vLLM's ``prompt_logprobs`` through the openai client (``extra_body``): one entry per prompt
token, null for the first, then each later token's logprob and rank with the k most likely
tokens there, the same scores ``echo`` with ``logprobs`` gives; per choice on
/v1/completions, on the response on /v1/chat/completions; bounded like ``logprobs``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from asyncengine.common.sampling_params import MAX_TOP_LOGPROBS
from tests.hf_scorer import HFScorer, hf, model_dir  # noqa: F401  (fixtures)
from tests.server_support import RunningServer, assert_no_leak, engine_config, start_server

pytestmark = pytest.mark.asyncio(loop_scope="module")
TOLERANCE = 1e-4
TEXT = "The radix tree shares prefixes between requests, so a scored prompt"
K = 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(model_dir: Path) -> AsyncIterator[RunningServer]:
    running = await start_server(engine_config(model_dir, enable_prefix_cache=False))
    yield running
    await running.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0
    ) as c:
        yield c


def check_shape(entries: list[Any], prompt: list[int], k: int) -> None:
    """Null first; then the prompt token with its rank, and ranks 1..k for the top k."""
    assert len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        entry = entries[position]
        own = entry[str(prompt[position])]
        assert isinstance(own["rank"], int) and own["rank"] >= 1
        assert isinstance(own["decoded_token"], str)
        top = sorted(entry.values(), key=lambda e: -e["logprob"])
        others = [e for key, e in entry.items() if key != str(prompt[position])]
        if own["rank"] <= k:
            assert len(entry) == k  # the prompt token is one of the top k
        else:
            assert len(entry) == k + 1 and [e["rank"] for e in others] == list(range(1, k + 1))
            assert own["logprob"] <= top[k - 1]["logprob"]
        assert top[0]["rank"] == 1


async def test_completions_give_each_prompt_token_its_logprob_rank_and_top_k(
    client: openai.AsyncOpenAI, server: RunningServer, hf: HFScorer
) -> None:
    prompt = server.engine.tokenize(TEXT)
    done = await client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        n=2,
        extra_body={"prompt_logprobs": K},
    )
    choices = [choice.model_dump() for choice in done.choices]
    entries = choices[0]["prompt_logprobs"]
    check_shape(entries, prompt, K)
    assert choices[1]["prompt_logprobs"] == entries  # every choice carries them
    # the same scores as echo with logprobs gives for the prompt (asked the same way: the
    # same batch shapes, the same floating-point sums)
    echoed = await client.completions.create(
        model=server.model, prompt=prompt, max_tokens=2, temperature=0, n=2, echo=True, logprobs=K
    )
    logprobs = echoed.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs and logprobs.top_logprobs
    reference = hf.logprobs(prompt)
    for position in range(1, len(prompt)):
        entry = entries[position]
        own = entry[str(prompt[position])]
        assert own["logprob"] == logprobs.token_logprobs[position]
        top_values = sorted((e["logprob"] for e in entry.values()), reverse=True)[:K]
        assert top_values == sorted(logprobs.top_logprobs[position].values(), reverse=True)
        # the rank is HF's: the tokens at least as likely as the prompt token
        row = reference[position - 1]
        assert abs(own["logprob"] - float(row[prompt[position]])) < TOLERANCE
        ahead = int((row > row[prompt[position]] + TOLERANCE).sum())
        tied = int((row >= row[prompt[position]] - TOLERANCE).sum())
        assert ahead + 1 <= own["rank"] <= tied


async def test_chat_gives_the_rendered_prompt_scores_once_on_the_response(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    chat = await client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": TEXT}],
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 0},
    )
    body = chat.model_dump()
    entries = body["prompt_logprobs"]
    assert chat.usage is not None and len(entries) == chat.usage.prompt_tokens
    assert entries[0] is None
    for entry in entries[1:]:  # k = 0: the prompt token alone
        ((token, own),) = entry.items()
        assert int(token) >= 0 and own["rank"] >= 1
    assert "prompt_logprobs" not in body["choices"][0]


async def test_prompt_logprobs_beside_echo_show_each_their_own_k(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    prompt = server.engine.tokenize(TEXT)[:12]
    done = await client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=1,
        echo=True,
        logprobs=1,
        temperature=0,
        extra_body={"prompt_logprobs": 5},
    )
    choice = done.choices[0]
    assert choice.logprobs is not None and choice.logprobs.top_logprobs
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1 : len(prompt)])
    check_shape(choice.model_dump()["prompt_logprobs"], prompt, 5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt_logprobs": MAX_TOP_LOGPROBS + 1}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_prompt_logprobs_out_of_bounds_or_streamed_are_a_400(
    client: openai.AsyncOpenAI, server: RunningServer, endpoint: str, body: Any, param: str
) -> None:
    body = dict(body)  # the parameters are shared between the endpoints
    stream = bool(body.pop("stream", False))
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            await client.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=1,
                stream=stream,
                extra_body=body,
            )
        else:
            await client.completions.create(
                model=server.model, prompt="hi", max_tokens=1, stream=stream, extra_body=body
            )
    assert param in str(caught.value)
    assert_no_leak(server.engine)
