"""What a user of the ``openai`` client gets from adapters written by scripts/make_lora.py: each
chat answer, requests for the adapters and the base sent at once, is token for token what
transformers writes greedily with PEFT's own merged model (``merge_and_unload``), with and
without prompt-lookup speculation."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.executor.lora_support import fresh_hf_model, write_adapters
from tests.server_support import engine_config, start_server, tiny_model_dir

NEW_TOKENS = 12
QUESTIONS = ["Name three colors.", "Repeat after me: red green blue red green blue red green"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_adapters(model_dir, tmp_path_factory.mktemp("client_loras"))


def chat_ids(model_dir: Path, question: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # a BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def merged_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list]:
    """transformers' greedy continuation of each prompt under PEFT's merged model (EOS ignored,
    as the requests ask)."""
    from peft import PeftModel

    model = fresh_hf_model(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            written = model.generate(
                ids,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(written[0, len(prompt) :].tolist())
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("speculative", [None, {"method": "ngram"}], ids=["plain", "ngram"])
async def test_each_adapters_chat_answer_is_peft_merged_models(
    model_dir: Path, adapters: dict[str, Path], speculative: dict[str, Any] | None
) -> None:
    prompts = [chat_ids(model_dir, q) for q in QUESTIONS]
    served: dict[str, Path | None] = {"r4": adapters["r4"], "r8": adapters["r8"], "base": None}
    want = {name: merged_greedy(model_dir, path, prompts) for name, path in served.items()}
    assert want["r4"] != want["r8"] != want["base"]  # each adapter changes what is written
    loras = {"r4": str(adapters["r4"]), "r8": str(adapters["r8"])}
    config = engine_config(model_dir, loras=loras, speculative=speculative, deterministic=True)
    server = await start_server(config)
    try:
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0
        ) as client:

            async def answer(name: str, question: str) -> tuple[list[int], int]:
                reply = await client.chat.completions.create(
                    model=server.model if name == "base" else name,
                    messages=[{"role": "user", "content": question}],
                    max_tokens=NEW_TOKENS,
                    temperature=0,
                    logprobs=True,
                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                )
                content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
                assert content is not None and reply.usage is not None
                ids = [int(t.token.removeprefix("token_id:")) for t in content]
                return ids, reply.usage.prompt_tokens

            jobs = [(name, i) for _ in range(2) for name in served for i in range(len(QUESTIONS))]
            got = await asyncio.gather(*(answer(name, QUESTIONS[i]) for name, i in jobs))
    finally:
        await server.stop()
    for (name, i), (ids, prompt_tokens) in zip(jobs, got, strict=True):
        assert prompt_tokens == len(prompts[i])  # the same chat template's tokens
        assert ids == want[name][i], (name, QUESTIONS[i])
