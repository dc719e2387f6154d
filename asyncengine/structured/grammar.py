"""Grammars for structured output, compiled with xgrammar off the event loop and cached.

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
    compiled = await compiler.compile(StructuredOutput.json_schema(schema))  # cached by spec
    matcher = GrammarMatcher(compiled)       # one per request (per choice): its own state
    matcher.next_bitmask()                   # int32 words, bit set = token allowed next
    matcher.accept(token_id)                 # advance; is_terminated() once it took EOS

Compilation runs on the compiler's own threads, so a long compile neither blocks the event loop
nor waits behind forwards. Requests for a spec that is being compiled wait for the same
compile. A spec xgrammar cannot compile, or not within the time limit, is an
``InvalidRequestError`` that names the problem (specs are capped in length at intake:
``sampling_params.MAX_GRAMMAR_CHARS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.common.sampling_params import InvalidRequestError, StructuredOutput

DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_WORKERS = 2
COMPILE_NICENESS = 10  # scripts/grammar_flood.py measures what a flood of compiles costs others
DEFAULT_COMPILE_TIMEOUT = 10.0  # seconds a compile may run before its spec is refused
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


def _problem(kind: str, error: Exception) -> InvalidRequestError:
    detail = " ".join(_LOG_PREFIX.sub("", str(error)).split())
    return InvalidRequestError(f"invalid {_WHAT[kind]}: {detail}")


@dataclass(eq=False)
class _Compile:
    """One spec's compile: the worker's future, when a worker took it up, and how many requests
    wait for it (none left before it starts: it is cancelled and never runs)."""

    job: Future[Any]
    future: asyncio.Future[Any]
    started: asyncio.Event
    started_at: list[float]  # the worker's time.monotonic() when it took the job up
    waiters: int = 0


class GrammarCompiler:
    """Compiles constraints for one tokenizer; keeps the last ``cache_size`` compiled grammars.

    ``tokenizer`` is the engine's (its ``backend`` is a ``tokenizers.Tokenizer``);
    ``vocab_size`` the width of the model's logits (it may exceed the tokenizer's).

    Compiles run on ``workers`` threads, first come first served. The work a client can make
    is bounded: a compile no waiting request wants any more (its clients went away) is
    cancelled before it starts; one that runs longer than ``timeout`` seconds is abandoned and
    its spec refused from then on (a thread cannot be stopped: it finishes in the background,
    holding one worker); ``json_object``, compiled first, never waits behind the queue.
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
        self._thread = ThreadPoolExecutor(
            workers, thread_name_prefix="asyncengine-grammar", initializer=_lower_priority
        )
        self._compiler_lock = threading.Lock()
        self._compiler: Any = None  # xgrammar's, built on a worker at the first compile
        self._json_object: _Compile | None = None
        self.compiles = 0  # grammars compiled (cache misses)
        self.abandoned = 0  # compiles past the time limit, left to finish in the background

    async def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar of ``constraint`` (from the cache, or compiled off the loop).
        InvalidRequestError when it does not compile, or not within ``timeout`` seconds."""
        if self._json_object is None:  # first in line: the plain JSON grammar never queues
            self._json_object = self._submit(StructuredOutput("json_object"))
        if constraint.kind == "json_object":
            entry = self._json_object
        else:
            entry = self._cache.get(constraint) or self._submit(constraint)
            self._cache[constraint] = entry
            self._cache.move_to_end(constraint)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        entry.waiters += 1
        try:
            if not entry.future.done() and not entry.started.is_set():  # queued
                started = asyncio.ensure_future(entry.started.wait())
                try:
                    await asyncio.wait([entry.future, started], return_when=FIRST_COMPLETED)
                finally:
                    started.cancel()
            if not entry.future.done():
                left = self.timeout - (time.monotonic() - entry.started_at[0])
                try:
                    await asyncio.wait_for(asyncio.shield(entry.future), max(left, 0.0))
                except asyncio.TimeoutError:
                    raise self._too_slow(constraint, entry) from None
            return entry.future.result()
        except InvalidRequestError:
            if self._cache.get(constraint) is entry:  # a failure is not cached (too slow is)
                del self._cache[constraint]
            raise
        finally:
            entry.waiters -= 1
            if entry.waiters == 0 and entry is not self._json_object and entry.job.cancel():
                if self._cache.get(constraint) is entry:  # nobody wants it: it never runs
                    del self._cache[constraint]

    def _submit(self, constraint: StructuredOutput) -> _Compile:
        loop = asyncio.get_running_loop()
        started, started_at = asyncio.Event(), []

        def run() -> Any:
            self._xgrammar_compiler()  # once per compiler, seconds: not the grammar's time
            started_at.append(time.monotonic())
            loop.call_soon_threadsafe(started.set)
            return self._compile_now(constraint)

        job = self._thread.submit(run)
        entry = _Compile(job, asyncio.wrap_future(job, loop=loop), started, started_at)
        entry.future.add_done_callback(_consume)
        return entry

    def _too_slow(self, constraint: StructuredOutput, entry: _Compile) -> InvalidRequestError:
        """Abandon ``entry``'s compile; the spec is refused from now on (it would take a worker
        for as long again)."""
        self.abandoned += 1
        error = InvalidRequestError(
            f"the {_WHAT[constraint.kind]} took longer than {self.timeout:g} s to compile: "
            "simplify it (fewer alternatives, smaller repetition bounds)",
            code="grammar_too_complex",
        )
        refused: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        refused.set_exception(error)
        refused.add_done_callback(_consume)
        done = _Compile(entry.job, refused, entry.started, entry.started_at)
        if constraint.kind != "json_object":
            self._cache[constraint] = done
        return error

    def _compile_now(self, constraint: StructuredOutput) -> Any:
        """On a worker thread (the first call imports xgrammar: over a second)."""
        compiler = self._xgrammar_compiler()
        self.compiles += 1
        try:
            if constraint.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if constraint.kind == "json_schema":
                # compact JSON: a model cannot pad the output with endless whitespace
                return compiler.compile_json_schema(constraint.spec, any_whitespace=False)
            if constraint.kind == "regex":
                return compiler.compile_regex(constraint.spec)
            if constraint.kind == "structural_tag":  # tool calls (structured/tool_grammar.py)
                return compiler.compile_structural_tag(constraint.spec)
            return compiler.compile_grammar(constraint.spec)
        except (RuntimeError, ValueError, TypeError) as error:
            raise _problem(constraint.kind, error) from None

    def _xgrammar_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                xgrammar = _import_xgrammar()
                from transformers import PreTrainedTokenizerFast

                wrapped = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                info = xgrammar.TokenizerInfo.from_huggingface(
                    wrapped, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


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

    Used on the event loop only: the core asks for the bitmask when it plans a step and
    advances the matcher when it commits the step's token.
    """

    def __init__(self, compiled: Any) -> None:
        xgrammar = _import_xgrammar()
        self._matcher = xgrammar.GrammarMatcher(compiled)  # rollback is unlimited
        self._words = xgrammar.get_bitmask_shape(1, compiled.tokenizer_info.vocab_size)[1]
        if self.allows_nothing():  # e.g. the regex "[^\\s\\S]": no output can ever match
            raise InvalidRequestError("the constraint admits no output: no token can begin it")

    def next_bitmask(self) -> torch.Tensor:
        """int32 [words]: bit i of word j set when token 32 j + i may come next. A fresh tensor
        each call: it travels to the forward thread with the plan."""
        bitmask = torch.empty((1, self._words), dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask[0]

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    def allows_nothing(self) -> bool:
        """No token may come next and the grammar is not complete (a regex like "a[^\\s\\S]"
        after its "a"): sampling from an all-forbidden row would pick an arbitrary token."""
        return not self._matcher.is_terminated() and not bool(self.next_bitmask().any())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding checks a row's
        guesses against the grammar at launch, then steps back)."""
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """The grammar is complete and took its end (an EOS token)."""
        return bool(self._matcher.is_terminated())
