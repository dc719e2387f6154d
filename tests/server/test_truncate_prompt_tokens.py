"""vLLM's ``truncate_prompt_tokens`` with the real client: completions, chat, embeddings,
/generate and the Python API run the prompt's last k tokens (a prompt past the context
included), and a value they cannot honour is a 400 that names it."""

from __future__ import annotations

import aiohttp
import numpy as np
import openai
import pytest

from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from tests.openai_server import client, server  # noqa: F401  (fixtures)
from tests.server_support import MAX_MODEL_LEN, RunningServer, assert_no_leak

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG = [100 + (37 * i) % 20000 for i in range(MAX_MODEL_LEN + 88)]  # past the context
KEEP = 40


def greedy(keep: int | None = None, max_tokens: int = 4) -> dict[str, object]:
    extra: dict[str, object] = {"ignore_eos": True}
    if keep is not None:
        extra["truncate_prompt_tokens"] = keep
    return {"max_tokens": max_tokens, "temperature": 0, "extra_body": extra}


async def test_completions_run_the_last_tokens(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    alone = await client.completions.create(model=server.model, prompt=LONG[-KEEP:], **greedy())
    for prompt in (LONG, LONG[-100:]):  # past the context, and within it
        cut = await client.completions.create(
            model=server.model,
            prompt=prompt,
            **greedy(KEEP),
        )
        assert cut.usage is not None and cut.usage.prompt_tokens == KEEP
        assert cut.choices[0].text == alone.choices[0].text
    text = " ".join(f"word{i}" for i in range(40))
    echoed = await client.completions.create(
        model=server.model, prompt=text, echo=True, **greedy(KEEP, max_tokens=1)
    )
    tokenizer = server.engine.tokenizer
    kept = tokenizer.decode(server.engine.tokenize(text)[-KEEP:], skip_special_tokens=False)
    assert len(kept) < len(text)
    assert echoed.choices[0].text.startswith(kept)  # the prompt it ran, not the one given
    assert_no_leak(server.engine)


async def test_chat_runs_the_last_tokens_of_the_rendered_conversation(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    messages = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]
    reply = await client.chat.completions.create(
        model=server.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": KEEP},
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == KEEP


async def test_embeddings_embed_the_last_tokens(
    client: openai.AsyncOpenAI, server: RunningServer
) -> None:
    alone = await client.embeddings.create(model=server.model, input=LONG[-KEEP:])
    cut = await client.embeddings.create(
        model=server.model, input=LONG, extra_body={"truncate_prompt_tokens": KEEP}
    )
    assert cut.usage.prompt_tokens == KEEP
    np.testing.assert_allclose(cut.data[0].embedding, alone.data[0].embedding, atol=1e-6)
    whole = await client.embeddings.create(
        model=server.model, input=LONG, extra_body={"truncate_prompt_tokens": -1}
    )
    assert whole.usage.prompt_tokens == MAX_MODEL_LEN  # -1: as many as the context holds


async def test_generate_runs_the_last_tokens(server: RunningServer) -> None:
    sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        bodies = (
            {"input_ids": LONG[-KEEP:], "sampling_params": sampling},
            {"input_ids": LONG, "sampling_params": {**sampling, "truncate_prompt_tokens": KEEP}},
        )
        answers = []
        for body in bodies:
            async with session.post(f"{server.base_url}/generate", json=body) as response:
                assert response.status == 200, await response.text()
                answers.append(await response.json())
    alone, cut = answers
    assert cut["meta_info"]["prompt_tokens"] == KEEP
    assert cut["output_ids"] == alone["output_ids"]


@pytest.mark.parametrize(
    ("value", "says"),
    [(0, "must be an integer >= 1, or -1"), (MAX_MODEL_LEN + 1, "more than the context")],
)
async def test_a_value_it_cannot_honour_is_refused(
    client: openai.AsyncOpenAI, server: RunningServer, value: int, says: str
) -> None:
    for call in (
        client.completions.create(
            model=server.model, prompt=LONG[:10], extra_body={"truncate_prompt_tokens": value}
        ),
        client.embeddings.create(
            model=server.model, input=LONG[:10], extra_body={"truncate_prompt_tokens": value}
        ),
    ):
        with pytest.raises(openai.BadRequestError, match=says) as refused:
            await call
        assert refused.value.param == "truncate_prompt_tokens"


async def test_the_python_api_runs_the_last_tokens(server: RunningServer) -> None:
    engine = server.engine
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    alone = await engine.generate(LONG[-KEEP:], params)
    params.truncate_prompt_tokens = KEEP
    cut = await engine.generate(LONG, params)
    assert cut.usage.prompt_tokens == KEEP and cut.token_ids == alone.token_ids
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens=-2"):
        await engine.generate(LONG, SamplingParams(truncate_prompt_tokens=-2))
