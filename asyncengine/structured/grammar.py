"""Grammars for structured output, compiled with xgrammar off the event loop and cached.

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
    compiled = await compiler.compile(StructuredOutput.json_schema(schema))  # cached by spec
    matcher = compiler.matcher(constraint, compiled)  # one per request (per choice)
    matcher.next_bitmask()                   # int32 words, bit set = token allowed next
    matcher.accept(token_id)                 # advance; is_terminated() once it took EOS

Compilation runs in the compiler's own worker processes (structured/compile_pool.py), so a
long compile neither blocks the event loop nor waits behind forwards, and one past the time
limit is killed. Requests for a spec that is being compiled wait for the same compile. A spec
xgrammar cannot compile, or not within the time limit, is an ``InvalidRequestError`` that
names the problem and the request field the spec came from (``StructuredOutput.param``; specs
are capped in length at intake: ``sampling_params.MAX_GRAMMAR_CHARS``).

A grammar's work per token can grow with its output (nested repetitions): each mask and token
of a matcher is timed, and one over ``MAX_STEP_SECONDS`` ends its request; its spec is then
refused like one that compiled too long, and so is a spec whose first mask (made in the
compile worker) is over the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.common.sampling_params import InvalidRequestError, StructuredOutput
from asyncengine.structured.compile_pool import (
    CompilePool,
    CompileTimeout,
    FirstStepTooSlow,
    WorkerGone,
)
from asyncengine.structured.compile_worker import COMPILE_NICENESS, compile_spec
from asyncengine.structured.schema_annotations import grammar_schema
from asyncengine.structured.schema_bounds import bounds_problem_in_spec
from asyncengine.structured.tokenizer_info import tokenizer_info

DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_WORKERS = 2
DEFAULT_COMPILE_TIMEOUT = 10.0  # seconds a compile may run before its spec is refused
# seconds one mask or token of a matcher may take: under a millisecond for the embedded model's
# vocabulary, but nested repetitions (the pattern "(([a-z]{0,100}){0,100}){0,100}") compile
# fast and then grow the matcher's work some tenfold per token, on the event loop
MAX_STEP_SECONDS = 0.25
# errors that stay cached: the spec would cost a worker as much again
REFUSED_FROM_NOW_ON = ("grammar_too_complex", "grammar_compiler_crashed")
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] [^\s:]+:\d+: ")  # "[06:27:45] /path/file.cc:83: "


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # an install without it: refuse the request, keep serving
        raise InvalidRequestError(
            "structured output needs the xgrammar package (pip install xgrammar)"
        ) from exc
    return xgrammar


_WHAT = {
    "json_schema": "JSON schema",
    "regex": "regular expression",
    "ebnf": "EBNF grammar",
    "json_object": "JSON grammar",
    "structural_tag": "tool-call grammar",
}


def _problem(kind: str, message: str) -> InvalidRequestError:
    detail = " ".join(_LOG_PREFIX.sub("", message).split())
    return InvalidRequestError(f"invalid {_WHAT[kind]}: {detail}")


def _too_slow(kind: str, detail: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"the {_WHAT[kind]} is too slow to follow: {detail}, over the limit of "
        f"{MAX_STEP_SECONDS:g} s a token: simplify it (fewer nested repetitions, smaller "
        "repetition bounds)",
        code="grammar_too_complex",
    )


@dataclass(eq=False)
class _Compile:
    """One spec's compile: the pool's future, and how many requests wait for it (none left
    before a worker takes it up: it is cancelled and never runs)."""

    job: Future[Any]
    future: asyncio.Future[Any]
    waiters: int = 0


class GrammarCompiler:
    """Compiles constraints for one tokenizer; keeps the last ``cache_size`` compiled grammars.

    ``tokenizer`` is the engine's (its ``backend`` is a ``tokenizers.Tokenizer``);
    ``vocab_size`` the width of the model's logits (it may exceed the tokenizer's).

    Compiles run in ``workers`` worker processes, first come first served, started with the
    compiler (seconds: forks of one process that imports xgrammar, and with it torch and
    transformers, once) and handing back the compiled grammar serialized. They start from xgrammar's view of the vocabulary,
    built once per tokenizer and kept in memory and on disk (structured/tokenizer_info.py). The work a client can make is bounded: a compile no waiting request
    wants any more (its clients went away) is cancelled before it starts; one that runs longer
    than ``timeout`` seconds is killed with its process (a fresh one takes its place) and its
    spec refused from then on; ``json_object``, compiled first and here, never waits behind
    the queue.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        workers: int = DEFAULT_COMPILE_WORKERS,
        timeout: float = DEFAULT_COMPILE_TIMEOUT,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self.timeout = timeout
        self._cache: OrderedDict[StructuredOutput, _Compile] = OrderedDict()
        self._here = ThreadPoolExecutor(
            1, thread_name_prefix="asyncengine-grammar-here", initializer=_lower_priority
        )
        self._compiler_lock = threading.Lock()
        self._compiler: Any = None  # xgrammar's, built on a thread at the first compile
        self._tokenizer_info: Any = None  # xgrammar's, with the compiler
        self._tokenizer_info_json = b""  # what the worker processes compile for
        self._json_object: _Compile | None = None
        self.compiles = 0  # grammars compiled (cache misses)
        self.pool = CompilePool(workers, self._worker_setup)

    @property
    def killed(self) -> int:
        """Compiles past the time limit (their worker processes killed)."""
        return self.pool.killed

    async def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar of ``constraint`` (from the cache, or compiled off the loop).
        InvalidRequestError when it does not compile, or not within ``timeout`` seconds."""
        if self._json_object is None:  # first in line: the plain JSON grammar never queues
            self._json_object = self._wrap(self._here.submit(self._compile_json_object))
        if constraint.kind == "json_object":
            entry = self._json_object
        else:
            entry = self._cache.get(constraint) or self._wrap(
                self.pool.submit(lambda: self._compile_now(constraint))
            )
            self._keep(constraint, entry)
        entry.waiters += 1
        try:
            return await asyncio.shield(entry.future)
        except Exception as error:
            # a failure is not cached, unless the spec would cost a worker as much again
            refused = getattr(error, "code", None) in REFUSED_FROM_NOW_ON
            if not refused and self._cache.get(constraint) is entry:
                del self._cache[constraint]
            if isinstance(error, InvalidRequestError) and error.param is None:
                if constraint.parts and not refused:
                    await self._name_the_part(constraint.parts)
                # the cached error is every requester's: each gets its own field named
                raise InvalidRequestError(str(error), constraint.param, error.code) from None
            raise
        finally:
            entry.waiters -= 1
            if entry.waiters == 0 and entry is not self._json_object and entry.job.cancel():
                if self._cache.get(constraint) is entry:  # nobody wants it: it never runs
                    del self._cache[constraint]

    async def _name_the_part(self, parts: tuple[StructuredOutput, ...]) -> None:
        """Raise the error of the first of ``parts`` that does not compile alone (naming its
        field); return if they all do (only their combination fails)."""
        for part in parts:
            await self.compile(part)

    def matcher(self, constraint: StructuredOutput, compiled: Any) -> GrammarMatcher:
        """A fresh matcher of ``compiled``, ``constraint``'s grammar (made on the event loop).
        Should one of its steps take over ``MAX_STEP_SECONDS``, ``constraint`` is refused from
        then on, as one whose compile ran past the time limit: its next request is a 400 at
        once, before any mask runs."""
        loop = asyncio.get_running_loop()

        def refuse(seconds: float) -> None:  # on the thread that timed the step
            error = _too_slow(constraint.kind, f"one token's step took {seconds:.2f} s")
            with contextlib.suppress(RuntimeError):  # the loop closed: no request comes
                loop.call_soon_threadsafe(self._refuse, constraint, error)

        return GrammarMatcher(compiled, refuse)

    def _refuse(self, constraint: StructuredOutput, error: InvalidRequestError) -> None:
        """``error`` is ``constraint``'s answer from now on (while the cache keeps it).
        json_object's grammar is everyone's: a slow step there ends its request only."""
        if constraint.kind == "json_object":
            return
        job: Future[Any] = Future()
        job.set_exception(error)
        self._keep(constraint, self._wrap(job))

    def _keep(self, constraint: StructuredOutput, entry: _Compile) -> None:
        """``entry`` cached as ``constraint``'s, the most recent; the oldest past the size go."""
        self._cache[constraint] = entry
        self._cache.move_to_end(constraint)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    @staticmethod
    def _wrap(job: Future[Any]) -> _Compile:
        entry = _Compile(job, asyncio.wrap_future(job))
        entry.future.add_done_callback(_consume)
        return entry

    def _compile_now(self, constraint: StructuredOutput) -> Any:
        """On a pool thread: compiled in the thread's worker process, then read back here."""
        self.compiles += 1
        spec = _given_spec(constraint)
        problem = bounds_problem_in_spec(constraint.kind, spec)
        if problem is not None:  # xgrammar would misread it, or refuse it in its own words
            raise InvalidRequestError(f"invalid JSON schema: {problem}")
        try:
            ok, payload = self.pool.compile(constraint.kind, spec, self.timeout, MAX_STEP_SECONDS)
        except FirstStepTooSlow as slow:
            raise _too_slow(constraint.kind, str(slow)) from None
        except CompileTimeout:
            raise InvalidRequestError(
                f"the {_WHAT[constraint.kind]} took longer than {self.timeout:g} s to compile: "
                "simplify it (fewer alternatives, smaller repetition bounds)",
                code="grammar_too_complex",
            ) from None
        except WorkerGone:
            raise InvalidRequestError(
                f"the {_WHAT[constraint.kind]} crashed the grammar compiler",
                code="grammar_compiler_crashed",
            ) from None
        if not ok:
            raise _problem(constraint.kind, payload.decode(errors="replace"))
        self._xgrammar_compiler()
        xgrammar = _import_xgrammar()
        return xgrammar.CompiledGrammar.deserialize_json(payload.decode(), self._tokenizer_info)

    def _compile_json_object(self) -> Any:
        """Here, on a thread (the first call imports xgrammar: over a second); JSON mode's
        grammar takes milliseconds."""
        compiler = self._xgrammar_compiler()
        self.compiles += 1
        return compile_spec(compiler, "json_object", "")

    def _worker_setup(self) -> bytes:
        """The serialized TokenizerInfo the worker processes start from."""
        self._xgrammar_compiler()
        return self._tokenizer_info_json

    def _xgrammar_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                xgrammar = _import_xgrammar()
                built = tokenizer_info(self._tokenizer.backend, self.vocab_size, self.eos_token_ids)
                self._tokenizer_info = built.xgrammar
                self._tokenizer_info_json = built.serialized
                self._compiler = xgrammar.GrammarCompiler(built.xgrammar, max_threads=1)
            return self._compiler

    def close(self) -> None:
        """Stop the compiles and return once no thread or process of the compiler is left
        (seconds while a thread still reads the tokenizer: call it off the event loop)."""
        self._here.shutdown(wait=False, cancel_futures=True)
        self.pool.close()
        self._here.shutdown(wait=True)


def _given_spec(constraint: StructuredOutput) -> str:
    """The spec as xgrammar is given it: a JSON schema as the grammar reads it (OpenAPI's
    ``nullable`` honoured, annotations dropped: structured/schema_annotations.py)."""
    if constraint.kind != "json_schema":
        return constraint.spec
    return json.dumps(grammar_schema(json.loads(constraint.spec)))


def _lower_priority() -> None:
    """A compile worker yields the cores to the forward and the event loop (Linux: a thread's
    nice value is its own)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)


def _consume(future: asyncio.Future[Any]) -> None:
    """Read a finished compile's outcome, so that one no request waits for logs nothing."""
    if not future.cancelled():
        future.exception()


class GrammarMatcher:
    """One request's position in its grammar (the ``Grammar`` a Request carries).

    Used by one thread at a time: the core makes a plan's masks on the forward thread, before
    its forward (xgrammar releases the GIL meanwhile, so the event loop goes on), and advances
    the matcher on the event loop when the plan lands; a request's next plan is made after
    that (core/engine_core.py). ``on_too_slow(seconds)`` is called, on the thread that timed
    it, by the first step over ``MAX_STEP_SECONDS``. Making one does no work: the grammar's
    first mask was made in the compile worker.
    """

    def __init__(self, compiled: Any, on_too_slow: Callable[[float], None] | None = None) -> None:
        xgrammar = _import_xgrammar()
        self._matcher = xgrammar.GrammarMatcher(compiled)  # rollback is unlimited
        self._words = xgrammar.get_bitmask_shape(1, compiled.tokenizer_info.vocab_size)[1]
        self._slowest = 0.0  # seconds of the slowest mask or token so far
        self._on_too_slow = on_too_slow

    def next_bitmask(self) -> torch.Tensor:
        """int32 [words]: bit i of word j set when token 32 j + i may come next. A fresh tensor
        each call: it travels to the forward thread with the plan."""
        bitmask = torch.empty((1, self._words), dtype=torch.int32)
        start = time.thread_time()
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        self._timed(start)
        return bitmask[0]

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""
        start = time.thread_time()
        accepted = bool(self._matcher.accept_token(token_id))
        self._timed(start)
        return accepted

    def too_slow(self) -> bool:
        """A mask or a token took more than ``MAX_STEP_SECONDS``."""
        return self._slowest > MAX_STEP_SECONDS

    def _timed(self, start: float) -> None:
        # this thread's CPU time: a busy host that leaves the thread waiting ends nothing
        seconds = time.thread_time() - start
        if seconds <= self._slowest:
            return
        first_too_slow = self._slowest <= MAX_STEP_SECONDS < seconds
        self._slowest = seconds
        if first_too_slow and self._on_too_slow is not None:
            self._on_too_slow(seconds)

    def allows_nothing(self) -> bool:
        """No token may come next and the grammar is not complete (a regex like "a[^\\s\\S]"
        after its "a"): sampling from an all-forbidden row would pick an arbitrary token."""
        return not self._matcher.is_terminated() and not bool(self.next_bitmask().any())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding checks a row's
        guesses against the grammar before the forward, then steps back)."""
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """The grammar is complete and took its end (an EOS token)."""
        return bool(self._matcher.is_terminated())
