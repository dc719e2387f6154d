"""The embedded model's tokenizer (SmolLM2's byte-level BPE), read once from its GGUF for the
text tests."""

from __future__ import annotations

import pytest

from asyncengine.executor.loader import DEFAULT_MODEL, KNOWN_MODELS, write_tokenizer_dir
from asyncengine.text.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("smollm2_tokenizer")
    write_tokenizer_dir(KNOWN_MODELS[DEFAULT_MODEL].gguf_path(), directory)
    return Tokenizer(directory)
