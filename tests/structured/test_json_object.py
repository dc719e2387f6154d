"""JSON mode (``response_format`` ``json_object``): an object, with bounded runs of whitespace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncengine.structured.compile_worker import JSON_OBJECT_WHITESPACE, compile_spec
from asyncengine.text.tokenizer import Tokenizer
from tests.server_support import tiny_model_dir


def _accepts(compiled: Any, tokenizer: Tokenizer, text: str) -> bool:
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    return bool(matcher.accept_string(text)) and bool(
        matcher.accept_token(tokenizer.eos_token_ids[0])
    )


@pytest.fixture(scope="module")
def json_mode(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Tokenizer]:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(Path(tiny_model_dir(tmp_path_factory)))
    info = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend),
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=tokenizer.eos_token_ids,
    )
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    return compile_spec(compiler, "json_object", ""), tokenizer


@pytest.mark.parametrize(
    "text",
    [
        '{"a": [1, {"b": null}], "c": "x"}',
        '{"a":1}',
        "{}",
        json.dumps({"order": {"items": [{"sku": "A1", "qty": 2}]}}, indent=2),
    ],
)
def test_objects_in_any_usual_layout_are_accepted(
    json_mode: tuple[Any, Tokenizer], text: str
) -> None:
    assert _accepts(*json_mode, text)


@pytest.mark.parametrize(
    "text",
    ["[1, 2]", '"text"', "7", "null", '{"a":' + " " * (JSON_OBJECT_WHITESPACE + 1) + "1}"],
)
def test_other_values_and_long_blank_runs_are_refused(
    json_mode: tuple[Any, Tokenizer], text: str
) -> None:
    assert not _accepts(*json_mode, text)
