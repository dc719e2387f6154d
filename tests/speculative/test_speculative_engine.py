"""Speculative decoding end to end on the embedded model (CPU): the Python API streams several
accepted tokens in one delta, structured output holds with guesses copied from the prompt,
usage and stats count accepted guesses, and the command line takes ``--speculative JSON`` (a
bad value is an error naming the key). Greedy exactness against decoding without speculation
is tests/speculative/test_speculative_model.py's (float32 and deterministic mode); in the default mode the
verify forward (an extend over 5 positions) and a decode round differently, and on this
workload the embedded model's greedy tokens agree for the first 15 tokens, then a near tie
flips (deterministic mode: all 48 agree, measured by hand, too slow for a test here)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from asyncengine.api.engine import AsyncEngine
from asyncengine.cli import main
from asyncengine.common.outputs import StreamDelta
from asyncengine.common.sampling_params import SamplingParams, StructuredOutput
from asyncengine.executor.loader import DEFAULT_MODEL
from tests.server_support import engine_config

pytestmark = pytest.mark.slow

CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
COPY_PROMPT = [
    {"role": "user", "content": f"Repeat this code exactly:\n{CODE}"},
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4}
RECORD = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


async def greedy_stream(
    prompt: object, **params: object
) -> tuple[list[list[int]], str, StreamDelta, dict[str, Any]]:
    """Token ids of each delta, the whole text, the last delta and the engine's stats."""
    config = engine_config(DEFAULT_MODEL, speculative=SPEC, kv_cache_tokens=4096)
    async with AsyncEngine(config) as engine:
        deltas: list[StreamDelta] = []
        sampling = SamplingParams(max_new_tokens=48, temperature=0, **params)  # type: ignore[arg-type]
        async for delta in engine.stream(prompt, sampling):
            deltas.append(delta)
        text = "".join(d.text for d in deltas)
        return [d.token_ids for d in deltas], text, deltas[-1], engine.stats()


@pytest.mark.asyncio
async def test_streams_accepted_tokens_together() -> None:
    frames, text, last, stats = await greedy_stream(COPY_PROMPT)
    assert max(map(len, frames)) > 1  # one frame, several tokens
    assert last.usage is not None and last.usage.accepted_speculative_tokens > 10
    assert "return a + b" in text
    assert stats["spec_acceptance_rate"] > 0.3 and stats["spec_accepted_per_step"] > 0.3
    assert stats["pages_used"] == 0


@pytest.mark.asyncio
async def test_structured_output_with_guesses_from_the_prompt() -> None:
    example = json.dumps({"name": "Ada", "age": 36})
    prompt = [{"role": "user", "content": f"Copy this JSON: {example}\nAgain: {example}"}]
    constraint = StructuredOutput.json_schema(RECORD)
    _, text, last, stats = await greedy_stream(prompt, structured=constraint)
    assert last.finish_reason == "stop"
    jsonschema.validate(json.loads(text), RECORD)
    assert stats["spec_verified_tokens"] > 0


def test_command_line_speculative_bad_value_names_the_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        ["generate", "hi", "--speculative", '{"method": "ngram", "num_speculative_tokens": -1}']
    )
    assert code == 2
    assert "speculative.num_speculative_tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--speculative", "{not json"])
