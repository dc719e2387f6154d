"""Grammars for structured output, compiled with xgrammar off the event loop and cached.

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
    compiled = await compiler.compile(StructuredOutput.json_schema(schema))  # cached by spec
    matcher = GrammarMatcher(compiled)       # one per request (per choice): its own state
    matcher.next_bitmask()                   # int32 words, bit set = token allowed next
    matcher.accept(token_id)                 # advance; is_terminated() once it took EOS

Compilation runs on the compiler's own thread, so a long compile neither blocks the event loop
nor waits behind forwards. Requests for a spec that is being compiled wait for the same
compile. A spec xgrammar cannot compile is an ``InvalidRequestError`` that names the problem.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from asyncengine.sampling_params import InvalidRequestError, StructuredOutput

DEFAULT_CACHE_SIZE = 256
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] [^\s:]+:\d+: ")  # "[06:27:45] /path/file.cc:83: "


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # an install without it: refuse the request, keep serving
        raise InvalidRequestError(
            "structured output needs the xgrammar package (pip install xgrammar)"
        ) from exc
    return xgrammar


def _problem(kind: str, error: Exception) -> InvalidRequestError:
    detail = " ".join(_LOG_PREFIX.sub("", str(error)).split())
    what = {
        "json_schema": "JSON schema",
        "regex": "regular expression",
        "ebnf": "EBNF grammar",
        "json_object": "JSON grammar",
        "structural_tag": "tool-call grammar",
    }[kind]
    return InvalidRequestError(f"invalid {what}: {detail}")


class GrammarCompiler:
    """Compiles constraints for one tokenizer; keeps the last ``cache_size`` compiled grammars.

    ``tokenizer`` is the engine's (its ``backend`` is a ``tokenizers.Tokenizer``);
    ``vocab_size`` the width of the model's logits (it may exceed the tokenizer's).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, asyncio.Future[Any]] = OrderedDict()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="asyncengine-grammar")
        self._compiler: Any = None  # xgrammar's, built on the thread at the first compile
        self.compiles = 0  # grammars compiled (cache misses)

    async def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar of ``constraint`` (from the cache, or compiled off the loop)."""
        future = self._cache.get(constraint)
        if future is not None:
            self._cache.move_to_end(constraint)
            return await asyncio.shield(future)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._thread, self._compile_now, constraint)
        self._cache[constraint] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        try:
            return await asyncio.shield(future)
        except Exception:
            if self._cache.get(constraint) is future:  # a failure is not cached
                del self._cache[constraint]
            raise

    def _compile_now(self, constraint: StructuredOutput) -> Any:
        """On the compiler's thread (the first call imports xgrammar: over a second)."""
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
