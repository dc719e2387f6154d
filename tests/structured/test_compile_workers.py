"""Grammar compiles run in worker processes: one past its time limit is killed (its process
gone, a fresh one in its place) and the next compile does not wait behind it; a worker that
dies mid-compile is a 400 for that spec and is replaced."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import torch

from asyncengine.api.engine import AsyncEngine
from asyncengine.common.sampling_params import (
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
)
from asyncengine.structured.compile_worker import COMPILE_NICENESS, compile_spec
from asyncengine.structured.grammar import GrammarCompiler, GrammarMatcher, _given_spec
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


def ended(pid: int) -> bool:
    """Gone, or a zombie its parent (this process) has not reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


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


async def test_workers_are_forks_of_one_single_threaded_template(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """xgrammar is imported once per pool: each worker is a fork of the template, which forks
    with one thread (none left behind holding a lock), and shares its memory and its lower
    priority."""
    async with started(tmp_path_factory, workers=2) as compiler:
        template = compiler.pool.template_pid()
        assert template is not None
        assert psutil.Process(template).num_threads() == 1
        for pid in compiler.pool.live_pids():
            worker = psutil.Process(pid)
            assert worker.ppid() == template
            assert worker.nice() == COMPILE_NICENESS  # the template's, below the engine's
            # a fresh interpreter with xgrammar holds some 200 MB of its own
            assert worker.memory_full_info().uss < 64 * 2**20


async def test_a_killed_worker_is_replaced_within_the_next_compile(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A worker killed while idle (as by the OOM killer) is replaced by a fork: the next
    compile pays milliseconds, not an interpreter's start with xgrammar's import."""
    async with started(tmp_path_factory, workers=1) as compiler:
        [pid] = compiler.pool.live_pids()
        os.kill(pid, signal.SIGKILL)
        assert await wait_until(lambda: ended(pid), timeout=10)
        start = time.monotonic()
        matcher = GrammarMatcher(await compiler.compile(StructuredOutput("regex", "[x-z]+")))
        assert time.monotonic() - start < 1.0
        assert matcher.accept(matcher_token(compiler, "x"))
        [replacement] = compiler.pool.live_pids()
        assert replacement != pid


async def test_a_killed_template_is_started_afresh(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Workers outlive their template; the next worker needed comes from a fresh template."""
    async with started(tmp_path_factory, workers=1) as compiler:
        template = compiler.pool.template_pid()
        [pid] = compiler.pool.live_pids()
        assert template is not None
        os.kill(template, signal.SIGKILL)
        assert await wait_until(lambda: ended(template), timeout=10)
        assert GrammarMatcher(await compiler.compile(StructuredOutput("regex", "[0-4]+")))
        assert compiler.pool.live_pids() == [pid]  # served by the same worker
        os.kill(pid, signal.SIGKILL)
        assert await wait_until(lambda: gone(pid), timeout=10)
        assert GrammarMatcher(await compiler.compile(StructuredOutput("regex", "[5-9]+")))
        assert compiler.pool.template_pid() not in (None, template)
        [replacement] = compiler.pool.live_pids()
        assert psutil.Process(replacement).ppid() == compiler.pool.template_pid()


def matcher_token(compiler: GrammarCompiler, text: str) -> int:
    [token] = compiler._tokenizer.encode(text)
    return int(token)


SAME_MASK_SPECS = [
    StructuredOutput.json_schema(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "tags": {"type": "array"}},
            "required": ["name"],
        }
    ),
    StructuredOutput("regex", "(cat|dog)s? [0-9]{2,4}"),
    StructuredOutput("ebnf", 'root ::= "yes" | "no" | "maybe " [a-z]+'),
]


@pytest.mark.parametrize("constraint", SAME_MASK_SPECS, ids=lambda c: c.kind)
async def test_a_forked_worker_compiles_the_same_masks_as_this_process(
    tmp_path_factory: pytest.TempPathFactory, constraint: StructuredOutput
) -> None:
    """The grammar a worker compiles gives, token for token, the masks of the same spec
    compiled here with xgrammar's own compiler."""
    async with started(tmp_path_factory, workers=1) as compiler:
        from_worker = GrammarMatcher(await compiler.compile(constraint))
        here = GrammarMatcher(
            compile_spec(compiler._xgrammar_compiler(), constraint.kind, _given_spec(constraint))
        )
        steps = 0
        while not here.is_terminated() and steps < 40:
            mask = here.next_bitmask()
            assert torch.equal(from_worker.next_bitmask(), mask)
            allowed = [
                32 * word + bit
                for word, value in enumerate(mask.tolist())
                for bit in range(32)
                if value >> bit & 1
            ]
            token = allowed[(7 * steps + 3) % len(allowed)]  # spread over what each step allows
            assert from_worker.accept(token) and here.accept(token)
            steps += 1
        assert steps > 3
        assert from_worker.is_terminated() == here.is_terminated()


# a process that starts a runaway compile, says its worker's pid, and waits to be killed
_DYING_ENGINE = """
import asyncio, sys
from asyncengine.structured.grammar import GrammarCompiler
from asyncengine.text.tokenizer import Tokenizer
from tests.structured.test_compile_workers import pathological_regex

async def main() -> None:
    tokenizer = Tokenizer(sys.argv[1])
    compiler = GrammarCompiler(
        tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, workers=1, timeout=300.0
    )
    compiling = asyncio.ensure_future(compiler.compile(pathological_regex()))
    while not compiler.pool.live_pids():
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # the job sent: the worker compiles
    print(compiler.pool.live_pids()[0], flush=True)
    await compiling

asyncio.run(main())
"""


async def test_a_compile_ends_with_the_engine_process_that_died(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """An engine process killed (SIGKILL, the OOM killer) mid-compile takes the compile with
    it: the worker, not its child, is gone within seconds, not when xgrammar finishes."""
    model = tiny_model_dir(tmp_path_factory)
    engine = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _DYING_ENGINE, str(model),
        stdout=asyncio.subprocess.PIPE, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    try:
        assert engine.stdout is not None
        line = await asyncio.wait_for(engine.stdout.readline(), 120)
        worker = int(line)
        assert psutil.Process(worker).status() != psutil.STATUS_ZOMBIE  # compiling
        assert psutil.Process(worker).cpu_times().user > 0
    finally:
        engine.kill()
        await engine.wait()
    if not await wait_until(lambda: gone(worker), timeout=10):
        os.kill(worker, signal.SIGKILL)  # a failure leaves no runaway compile behind
        pytest.fail(f"compile worker {worker} outlived its engine process")


async def test_stopping_the_engine_mid_compile_ends_the_worker(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A runaway compile (its limit far off) does not outlive the engine's stop."""
    config = engine_config(
        tiny_model_dir(tmp_path_factory), grammar_compile_workers=1, grammar_compile_timeout=300.0
    )
    engine = AsyncEngine(config)
    await engine.start()
    params = SamplingParams(max_new_tokens=4, structured=pathological_regex())
    try:
        pending = asyncio.ensure_future(engine.generate("hello", params))
        assert await wait_until(
            lambda: (
                engine.held.compiler is not None and bool(engine.held.compiler.pool.live_pids())
            ),
            timeout=60,
        )
        [worker] = engine.held.compiler.pool.live_pids()
        await asyncio.sleep(0.5)  # compiling
        assert not gone(worker)
    finally:
        await engine.stop()
    assert await wait_until(lambda: gone(worker), timeout=10)  # killed, and reaped
    assert compile_children() == []
    assert (await pending).finish_reason == "abort"
