"""xgrammar's TokenizerInfo is built once per tokenizer: a second grammar compiler in the process
takes it from memory, a fresh process from the disk cache; the key tells apart vocab sizes, stop
tokens and tokenizer contents; a corrupt or foreign cache file is rebuilt and its grammars give
the same masks, token for token, as an uncached build's; concurrent writers never leave half a
file to read."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xgrammar
from tokenizers import Tokenizer as Backend
from transformers import PreTrainedTokenizerFast

from asyncengine.common.private_cache import CACHE_ENV, STALE_AFTER_S, write_private_file
from asyncengine.common.sampling_params import StructuredOutput
from asyncengine.structured import tokenizer_info as cache
from asyncengine.structured.compile_worker import compile_spec
from asyncengine.structured.grammar import GrammarCompiler, GrammarMatcher, _given_spec
from asyncengine.text.tokenizer import Tokenizer
from tests.server_support import tiny_model_dir

REAL_FROM_HUGGINGFACE = xgrammar.TokenizerInfo.from_huggingface

# (constraint, an output it admits)
CONSTRAINTS = [
    (
        StructuredOutput.json_schema(
            {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            }
        ),
        '{"name": "Ann \\u00e9 \\"x\\"", "age": 31}',
    ),
    (
        StructuredOutput.json_schema(
            {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}
        ),
        '["green", "red"]',
    ),
    (StructuredOutput("regex", "(yes|no|maybe) [0-9]{2,3}!"), "maybe 120!"),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(tiny_model_dir(tmp_path_factory))  # before the cache moves: converted once


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[int]]:
    """An empty cache directory and process memory; the vocab size of each from_huggingface
    call from here on."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    made: list[int] = []

    def from_huggingface(tokenizer: Any, vocab_size: int, **kwargs: Any) -> Any:
        made.append(vocab_size)
        return REAL_FROM_HUGGINGFACE(tokenizer, vocab_size=vocab_size, **kwargs)

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", from_huggingface)
    cache.forget_in_memory()
    yield made
    cache.forget_in_memory()


def uncached_info(tokenizer: Tokenizer) -> Any:
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return REAL_FROM_HUGGINGFACE(
        wrapped, vocab_size=tokenizer.vocab_size, stop_token_ids=tokenizer.eos_token_ids
    )


def masks_along(matcher: GrammarMatcher, tokens: list[int]) -> list[torch.Tensor]:
    """The mask before each token, each token accepted in turn; the grammar then complete."""
    masks = []
    for token in tokens:
        masks.append(matcher.next_bitmask())
        assert matcher.accept(token)
    assert matcher.is_terminated()
    return masks


async def assert_masks_as_uncached(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    reference = xgrammar.GrammarCompiler(uncached_info(tokenizer), max_threads=1)
    for constraint, output in CONSTRAINTS:
        tokens = [*tokenizer.encode(output), tokenizer.eos_token_ids[0]]
        compiled = await compiler.compile(constraint)
        got = masks_along(compiler.matcher(constraint, compiled), tokens)
        uncached = compile_spec(reference, constraint.kind, _given_spec(constraint))
        expected = masks_along(GrammarMatcher(uncached), tokens)
        assert len(got) == len(expected) == len(tokens)
        for step, (mask, want) in enumerate(zip(got, expected, strict=True)):
            assert torch.equal(mask, want), (constraint, step)


def new_compiler(tokenizer: Tokenizer, workers: int = 1) -> GrammarCompiler:
    """(No worker process: json_object only, which compiles in this process.)"""
    return GrammarCompiler(
        tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, workers=workers
    )


async def test_a_second_compiler_and_a_fresh_process_build_no_tokenizer_info(
    tokenizer: Tokenizer, builds: list[int]
) -> None:
    first, second = new_compiler(tokenizer, workers=0), new_compiler(tokenizer, workers=0)
    try:
        for compiler in (first, second):
            assert await compiler.compile(StructuredOutput("json_object"))
        assert builds == [tokenizer.vocab_size]  # the second one took it from memory
        cache.forget_in_memory()  # as a fresh process: the disk cache is left
        third = new_compiler(tokenizer)
        try:
            await assert_masks_as_uncached(third, tokenizer)  # in its worker process too
        finally:
            third.close()
        assert builds == [tokenizer.vocab_size]
    finally:
        first.close()
        second.close()


def test_the_key_tells_apart_vocab_sizes_stop_ids_and_tokenizers(tokenizer: Tokenizer) -> None:
    backend, vocab, eos = tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_ids
    key = cache.tokenizer_info_key(backend, vocab, eos).digest()
    assert cache.tokenizer_info_key(Backend.from_str(backend.to_str()), vocab, eos).digest() == key
    grown = Backend.from_str(backend.to_str())
    grown.add_tokens(["<tool_result>"])
    others = [
        cache.tokenizer_info_key(backend, vocab + 64, eos),
        cache.tokenizer_info_key(backend, vocab, [*eos, 0]),
        cache.tokenizer_info_key(backend, vocab, []),
        cache.tokenizer_info_key(grown, vocab, eos),
    ]
    assert len({key, *(other.digest() for other in others)}) == 1 + len(others)
    versions = cache.tokenizer_info_key(backend, vocab, eos).library_versions
    assert any(v.startswith("xgrammar ") for v in versions)


def test_another_vocab_size_or_stop_ids_is_built_for_them(
    tokenizer: Tokenizer, builds: list[int]
) -> None:
    backend, vocab, eos = tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_ids
    plain = cache.tokenizer_info(backend, vocab, eos)
    wider = cache.tokenizer_info(backend, vocab + 64, eos)
    more_stops = cache.tokenizer_info(backend, vocab, [*eos, 0])
    assert builds == [vocab, vocab + 64, vocab]
    assert (plain.xgrammar.vocab_size, wider.xgrammar.vocab_size) == (vocab, vocab + 64)
    assert sorted(more_stops.xgrammar.stop_token_ids) == sorted({*eos, 0})
    assert cache.tokenizer_info(backend, vocab + 64, eos) is wider
    assert len(builds) == 3


def test_a_build_sweeps_the_infos_no_process_read_for_a_month(
    tokenizer: Tokenizer, builds: list[int]
) -> None:
    """Each tokenizer or library version leaves an info behind: a read marks its file in use,
    and each info written deletes those (and left-over temporary files) unread for
    ``STALE_AFTER_S``, keeping the ones read since."""
    backend, vocab, eos = tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_ids
    cache.tokenizer_info(backend, vocab, eos)
    kept = cache.cache_file(cache.tokenizer_info_key(backend, vocab, eos))
    directory = kept.parent
    month_ago = time.time() - STALE_AFTER_S - 60
    stale = directory / ("0" * 32 + ".json")  # an older library version's
    staging = directory / f".{stale.name}.a1b2c3"  # a writer killed before its rename
    for path in (stale, staging):
        path.write_bytes(kept.read_bytes())
    for path in (stale, staging, kept):
        os.utime(path, (month_ago, month_ago))
    cache.forget_in_memory()
    assert cache.tokenizer_info(backend, vocab, eos)  # read from disk (a fresh process)
    assert kept.stat().st_mtime > month_ago + 60  # marked in use
    assert builds == [vocab] and stale.exists()  # a read writes nothing, so sweeps nothing
    cache.tokenizer_info(backend, vocab + 64, eos)  # built and written: sweeps
    assert builds == [vocab, vocab + 64]
    assert not stale.exists() and not staging.exists()
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [kept.name, cache.cache_file(cache.tokenizer_info_key(backend, vocab + 64, eos)).name]
    )


def spoil(path: Path, how: str) -> None:
    if how == "garbage":
        path.write_bytes(b"\x00\xffnot json")
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "another key's":  # whole and valid, but for another vocab size
        path.write_bytes(wider_info(path.read_bytes()))
    elif how == "writable by others":  # whole, but anyone could have written it: not read
        os.chmod(path, 0o666)


def wider_info(serialized: bytes) -> bytes:
    """The serialized info of the same tokenizer for logits 32 wider."""
    info = xgrammar.TokenizerInfo.deserialize_json(serialized.decode())
    wider = xgrammar.TokenizerInfo(
        info.decoded_vocab, info.vocab_type, vocab_size=info.vocab_size + 32,
        stop_token_ids=info.stop_token_ids, add_prefix_space=info.add_prefix_space,
    )  # fmt: skip
    return str(wider.serialize_json()).encode()


@pytest.mark.parametrize(
    "how", ["garbage", "truncated", "empty", "another key's", "writable by others"]
)
async def test_a_spoiled_cache_file_is_rebuilt_and_its_grammars_are_exact(
    tokenizer: Tokenizer, builds: list[int], how: str
) -> None:
    backend, vocab, eos = tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_ids
    cache.tokenizer_info(backend, vocab, eos)
    path = cache.cache_file(cache.tokenizer_info_key(backend, vocab, eos))
    spoil(path, how)
    cache.forget_in_memory()
    compiler = new_compiler(tokenizer)
    try:
        await assert_masks_as_uncached(compiler, tokenizer)
    finally:
        compiler.close()
    assert builds == [vocab, vocab]  # rebuilt, not an error
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert xgrammar.TokenizerInfo.deserialize_json(path.read_text()).vocab_size == vocab
    cache.forget_in_memory()
    cache.tokenizer_info(backend, vocab, eos)
    assert len(builds) == 2  # the replacement is read back


def test_an_unusable_cache_directory_costs_the_cache_only(
    tokenizer: Tokenizer, builds: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(not_a_directory))
    built = cache.tokenizer_info(tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_ids)
    assert built.xgrammar.vocab_size == tokenizer.vocab_size and len(builds) == 1


def test_concurrent_writers_leave_a_loadable_file(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """Writers replacing the file while a reader reads it: the reader only ever sees a whole
    one, and no temporary file is left behind."""
    one = uncached_info(tokenizer).serialize_json().encode()
    other = wider_info(one)
    path = tmp_path / "info.json"
    write_private_file(path, one)
    writing = threading.Event()
    writing.set()
    problems: list[str] = []

    def write(data: bytes) -> None:
        for _ in range(40):
            write_private_file(path, data)

    def read() -> None:
        while writing.is_set():
            text = path.read_text()
            try:
                xgrammar.TokenizerInfo.deserialize_json(text)
            except RuntimeError as error:
                problems.append(f"{len(text)} chars: {error}"[:200])

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(data,)) for data in (one, other) * 2]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    writing.clear()
    reader.join()
    assert problems == []
    assert path.read_bytes() in (one, other)
    assert [p.name for p in tmp_path.iterdir()] == ["info.json"]
