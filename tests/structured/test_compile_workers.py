"""Grammar compiles run in worker processes: one past its time limit is killed (its process
gone, a fresh one in its place) and the next compile does not wait behind it; a worker that
dies mid-compile is a 400 for that spec and is replaced."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator

import psutil
import pytest

from asyncengine.api.engine import AsyncEngine
from asyncengine.common.sampling_params import (
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
)
from asyncengine.structured.grammar import GrammarCompiler, GrammarMatcher
from asyncengine.text.tokenizer import Tokenizer
from tests.server_support import engine_config, tiny_model_dir, wait_until


def pathological_regex() -> StructuredOutput:
    """xgrammar compiles this for tens of seconds (12 such classes: ~5 s)."""
    classes = "".join(f"[{chr(97 + i % 20)}-z]{{1,{4000 + i}}}" for i in range(30))
    return StructuredOutput("regex", classes)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextlib.asynccontextmanager
async def started(
    tmp_path_factory: pytest.TempPathFactory, workers: int
) -> AsyncIterator[GrammarCompiler]:
    tokenizer = Tokenizer(tiny_model_dir(tmp_path_factory))
    compiler = GrammarCompiler(
        tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, workers=workers, timeout=1.0
    )
    try:
        # every process started (xgrammar imported: seconds) before anything is timed
        await asyncio.gather(
            *(compiler.compile(StructuredOutput("regex", f"[0-9]{{{i}}}")) for i in range(workers))
        )
        assert await wait_until(lambda: len(compiler.pool.live_pids()) == workers, timeout=60)
        yield compiler
    finally:
        compiler.close()


@pytest.fixture
async def compiler(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GrammarCompiler]:
    async with started(tmp_path_factory, workers=2) as compiler:
        yield compiler


async def test_a_compile_past_the_limit_is_killed(compiler: GrammarCompiler) -> None:
    before = set(compiler.pool.live_pids())
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="took longer than 1 s to compile"):
        await compiler.compile(pathological_regex())
    assert time.monotonic() - start < 10.0  # killed at the limit, not tens of seconds later
    assert compiler.killed == 1
    killed = before - set(compiler.pool.live_pids())
    assert len(killed) == 1 and all(gone(pid) for pid in killed)
    # the next compile runs now, on the other worker, not behind the killed one
    start = time.monotonic()
    matcher = GrammarMatcher(await compiler.compile(StructuredOutput("regex", "(red|blue)")))
    assert time.monotonic() - start < 2.0
    assert not matcher.is_terminated()
    # a fresh process takes the killed one's place; the spec stays refused without a compile
    assert await wait_until(
        lambda: len(compiler.pool.live_pids()) == compiler.pool.size, timeout=60
    )
    assert not killed & set(compiler.pool.live_pids())
    compiles = compiler.compiles
    with pytest.raises(InvalidRequestError, match="took longer than"):
        await compiler.compile(pathological_regex())
    assert compiler.compiles == compiles


async def test_a_worker_that_dies_mid_compile_is_replaced(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    async with started(tmp_path_factory, workers=1) as compiler:
        [pid] = compiler.pool.live_pids()
        compiling = asyncio.ensure_future(compiler.compile(pathological_regex()))
        await asyncio.sleep(0.3)
        os.kill(pid, signal.SIGKILL)  # as the kernel's OOM killer, or a crash in xgrammar
        with pytest.raises(InvalidRequestError, match="crashed the grammar compiler"):
            await compiling
        assert compiler.killed == 0
        assert GrammarMatcher(await compiler.compile(StructuredOutput("regex", "[a-c]+")))
        assert compiler.pool.live_pids() not in ([], [pid])


async def test_a_json_schema_reads_openapi_nullable_as_null_allowed(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """response_format and the Python API's json_schema go through the compiler: a field
    marked ``nullable: true`` takes null, as clients generated from OpenAPI specs expect."""
    tokenizer = Tokenizer(tiny_model_dir(tmp_path_factory))
    schema = {
        "type": "object",
        "properties": {"note": {"type": "string", "nullable": True}, "n": {"type": "integer"}},
        "required": ["note", "n"],
        "additionalProperties": False,
    }

    def accepts(compiled: object, text: str) -> bool:
        matcher = GrammarMatcher(compiled)
        ids = [*tokenizer.encode(text), tokenizer.eos_token_ids[0]]
        return all(matcher.accept(token) for token in ids) and matcher.is_terminated()

    async with started(tmp_path_factory, workers=1) as compiler:
        compiled = await compiler.compile(StructuredOutput.json_schema(schema))
        assert accepts(compiled, '{"note": null, "n": 1}')
        assert accepts(compiled, '{"note": "hi", "n": 1}')
        assert not accepts(compiled, '{"note": "hi", "n": null}')


def grammar_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("asyncengine-grammar")]


def compile_children() -> list[int]:
    """This process's compile worker processes, zombies (killed, not yet reaped) included."""
    children = psutil.Process().children(recursive=True)
    return [p.pid for p in children if "compile_worker.py" in " ".join(_cmdline(p))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return ["compile_worker.py"]  # a zombie's command line is gone: count it


@pytest.mark.parametrize("when", ["workers ready", "tokenizer info building"])
async def test_engine_close_leaves_no_compile_thread_or_process(
    tmp_path_factory: pytest.TempPathFactory, when: str
) -> None:
    """A program that closes an engine and checks its threads, or starts the next engine,
    finds none of the compiler's threads or processes left."""
    config = engine_config(tiny_model_dir(tmp_path_factory), grammar_compile_workers=2)
    params = SamplingParams(max_new_tokens=4, structured=StructuredOutput("regex", "[0-9]+"))
    engine = AsyncEngine(config)
    await engine.start()
    try:
        if when == "workers ready":
            await engine.generate("hello", params)
            pool = engine.held.compiler.pool
            assert await wait_until(lambda: len(pool.live_pids()) == pool.size, timeout=60)
        else:  # closed while the first request's compile has only just begun
            pending = asyncio.ensure_future(engine.generate("hello", params))
            assert await wait_until(lambda: bool(grammar_threads()), timeout=60)
        assert grammar_threads()
    finally:
        await engine.close()
    assert grammar_threads() == []
    assert compile_children() == []
    if when != "workers ready":
        assert (await pending).finish_reason == "abort"
