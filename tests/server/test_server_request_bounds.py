"""Requests that would cost the server more than their output, or crash it, over real HTTP on
the tiny model: each gets a 400 that names the limit, or stays within its bound."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tokenizers import Tokenizer, decoders

from asyncengine.common.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_TOKEN_IDS,
)
from tests.openai_server import server  # noqa: F401  (fixture)
from tests.server_support import RunningServer, engine_config, start_server, tiny_model_dir

pytestmark = pytest.mark.asyncio(loop_scope="module")

COMPLETIONS = "/v1/completions"


async def post(server: RunningServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(server.base_url + path, json=body) as response:
            return response.status, await response.json()


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (completion(logit_bias={"²": 1}), "'²' is not a token id"),  # isdigit() but not int()
        (completion(logit_bias={"9" * 5000: 1}), "5000 characters"),  # past int()'s digit limit
        (completion(logit_bias={"٣": 1}), "is not a token id"),  # an Arabic-Indic digit
        (completion(logit_bias={"1": 100.5}), "is not in [-100, 100]"),
        (
            completion(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}),
            f"limit of {MAX_LOGIT_BIAS_ENTRIES}",
        ),
        (
            completion(stop=["x" * (MAX_STOP_STRING_LENGTH + 1)]),
            f"limit of {MAX_STOP_STRING_LENGTH}",
        ),
        (
            completion(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))),
            f"limit of {MAX_STOP_TOKEN_IDS}",
        ),
        (completion(regex="[^\\s\\S]"), "admits no output"),  # a grammar no token can begin
    ],
    ids=[
        "superscript",
        "long-digits",
        "arabic-digit",
        "bias-value",
        "bias-entries",
        "stop-length",
        "stop-ids",
        "empty-grammar",
    ],
)
async def test_bad_bounds_are_400s(server: RunningServer, body: dict[str, Any], says: str) -> None:
    status, answer = await post(server, COMPLETIONS, body)
    assert status == 400, answer
    assert says in answer["error"]["message"], answer


async def test_limits_themselves_are_served(server: RunningServer) -> None:
    """Exactly at each limit the request is served."""
    status, answer = await post(
        server,
        COMPLETIONS,
        completion(
            logit_bias={str(i): 0.5 for i in range(MAX_LOGIT_BIAS_ENTRIES)},
            stop=["y" * MAX_STOP_STRING_LENGTH],
            stop_token_ids=list(range(100, 100 + MAX_STOP_TOKEN_IDS)),
            temperature=0,
        ),
    )
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_long_stop_strings_holding_back_the_whole_output(server: RunningServer) -> None:
    """Fifteen stop strings at the length limit, one of which keeps matching the output (a
    single repeated character, forced by logit_bias) so that everything is held back until
    the end: the output comes back whole, and it ends by length."""
    ids = server.engine.tokenizer.encode("a", add_special_tokens=False)
    assert len(ids) == 1
    forced = ids[0]
    stops = ["a" * (MAX_STOP_STRING_LENGTH - 1) + "!"] + [
        chr(ord("b") + i) * MAX_STOP_STRING_LENGTH for i in range(14)
    ]
    max_tokens = 500  # within the test model's context of 512
    status, answer = await post(
        server,
        COMPLETIONS,
        completion(max_tokens=max_tokens, stop=stops, logit_bias={str(forced): 100}, temperature=0),
    )
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == "a" * max_tokens


async def test_nul_in_a_header_is_a_400_logged_in_one_info_line(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Bad: a\x00b\r\n\r\n")
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status_line.split()[1] == b"400"
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records, "the bad request is logged"
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in records)
    assert all("\n" not in r.getMessage() and "\x00" not in r.getMessage() for r in records)


async def test_echo_scoring_many_prompts_many_times_is_refused_with_the_figures(
    server: RunningServer,
) -> None:
    """echo + logprobs 20 + max_tokens 0 + n 16 over 256 prompts (of 500 ids: the test model's
    context is 512): a 400 naming the budget and the request's figure, before any scoring."""
    prompts = [[(i * 7 + j) % 40000 + 100 for j in range(500)] for i in range(256)]
    body = {"prompt": prompts, "echo": True, "logprobs": 20, "max_tokens": 0, "n": 16}
    status, answer = await post(server, COMPLETIONS, body)
    assert status == 400, answer
    message = answer["error"]["message"]
    budget = server.engine.config.max_logprob_entries
    wanted = 256 * 499 * 21 * 16  # positions after the first, (20 alternatives + 1), n
    assert f"{wanted} logprobs" in message and f"budget of {budget}" in message, message
    assert answer["error"]["param"] == "logprobs"


async def test_echo_within_the_budget_is_served(server: RunningServer) -> None:
    prompts = [[(i * 7 + j) % 40000 + 100 for j in range(50)] for i in range(2)]
    body = {"prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 0, "n": 2}
    status, answer = await post(server, COMPLETIONS, body)
    assert status == 200, answer
    assert len(answer["choices"]) == 4
    assert all(len(c["logprobs"]["tokens"]) == 50 for c in answer["choices"])


async def test_generate_counts_its_logprobs_against_the_budget(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """/generate takes one prompt (a batch is a 400): the prompt's scored positions and the
    generated ones, times (alternatives + 1), times n, against the budget, as
    /v1/completions sums them over its prompts."""
    budget = 50_000
    config = engine_config(tiny_model_dir(tmp_path_factory), max_logprob_entries=budget)
    running = await start_server(config)
    try:
        ids = [(j * 7) % 40000 + 100 for j in range(400)]

        def body(n: int) -> dict[str, Any]:
            return {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 1, "n": n},
                "return_logprob": True,
                "top_logprobs_num": 20,
                "logprob_start_len": 0,
            }

        status, answer = await post(running, "/generate", body(8))
        assert status == 400, answer
        wanted = (399 + 1) * 21 * 8  # scored prompt positions + the generated one
        assert f"{wanted} logprobs" in answer["error"]["message"], answer
        assert f"budget of {budget}" in answer["error"]["message"]
        status, answer = await post(running, "/generate", body(4))  # 33,600: within it
        assert status == 200, answer
        assert len(answer) == 4
        status, answer = await post(running, "/generate", {**body(1), "input_ids": [ids, ids]})
        assert status == 400, answer
    finally:
        await running.stop()


def _windowed_decoder_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its byte-level decoder wrapped in a sequence: the same text, read
    back by decoding windows of tokens (as for sentencepiece tokenizers) instead of a table."""
    target = tmp_path_factory.mktemp("tiny_windowed_decoder")
    shutil.copytree(tiny_model_dir(tmp_path_factory), target, dirs_exist_ok=True)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    tokenizer.decoder = decoders.Sequence([decoders.ByteLevel()])
    tokenizer.save(str(target / "tokenizer.json"))
    return target


async def test_an_output_of_bytes_that_never_make_a_character_is_decoded_a_window_at_a_time(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Allowed only a UTF-8 lead byte, the model writes U+FFFD after U+FFFD: each step still
    decodes a few tokens, not the whole output so far (quadratic in its length)."""
    running = await start_server(engine_config(_windowed_decoder_model(tmp_path_factory)))
    tokenizer = running.engine.tokenizer
    lead = tokenizer.backend.token_to_id("ð")  # the byte 0xF0 in the byte-level alphabet
    longest = 0
    decode = type(tokenizer).decode

    def recording(ids: list[int], skip_special_tokens: bool = True) -> str:
        nonlocal longest
        longest = max(longest, len(ids))
        return decode(tokenizer, ids, skip_special_tokens)

    tokenizer.decode = recording  # type: ignore[method-assign]
    try:
        status, answer = await post(
            running,
            COMPLETIONS,
            completion(max_tokens=300, ignore_eos=True, allowed_token_ids=[lead]),
        )
    finally:
        await running.stop()
    assert status == 200, answer
    assert answer["choices"][0]["text"] == "\ufffd" * 300
    assert longest <= 16, longest


async def test_a_batch_larger_than_the_queue_is_400_not_a_503_to_retry(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A batch of more prompts than max_waiting_requests could never be admitted: retrying its
    503 would only submit and abort part of it again."""
    config = engine_config(tiny_model_dir(tmp_path_factory), max_waiting_requests=8)
    running = await start_server(config)
    try:
        status, body = await post(running, COMPLETIONS, completion(prompt=["a"] * 9))
        assert status == 400, body
        assert body["error"]["param"] == "prompt"
        assert "max_waiting_requests=8" in body["error"]["message"]
        status, body = await post(running, COMPLETIONS, completion(prompt=["a"] * 8))
        assert status == 200 and len(body["choices"]) == 8, body
        status, body = await post(running, "/v1/embeddings", {"input": ["a"] * 9})
        assert status == 400 and body["error"]["param"] == "input", body
        status, body = await post(running, "/v1/embeddings", {"input": ["a"] * 8})
        assert status == 200 and len(body["data"]) == 8, body
    finally:
        await running.stop()
