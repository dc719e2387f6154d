"""Requests waiting for their structured-output grammar: compiled off the event loop (by the
GrammarCompiler, made at the first constrained request), then queued with their matchers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from asyncengine.api.request_group import RequestGroup
from asyncengine.api.streams import Streams
from asyncengine.common.config import EngineConfig
from asyncengine.common.errors import RequestFailedError
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams, StructuredOutput
from asyncengine.core.engine_core import EngineCore

log = logging.getLogger("asyncengine.api.engine")


class GrammarWait:
    """The groups whose grammar compiles; ``add`` queues a group once it has its matchers."""

    def __init__(
        self,
        config: EngineConfig,
        streams: Streams,
        core: Callable[[], EngineCore],
        tokenizer: Callable[[], Any],
        add: Callable[[RequestGroup], None],
    ) -> None:
        self.config = config
        self.streams = streams
        self._core = core
        self._tokenizer = tokenizer
        self._add = add
        self.compiler: Any = None  # the GrammarCompiler, made at the first constrained request
        self.waiting = 0  # requests waiting for their grammar (counted as waiting)

    def submit(self, group: RequestGroup, params: SamplingParams) -> None:
        """Compile the group's grammar in a task (``group.compiling``: an abort cancels it)."""
        self.waiting += 1
        group.compiling = asyncio.create_task(self._compile_then_add(group, params))

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
            self.compiler = None

    async def _compile_then_add(self, group: RequestGroup, params: SamplingParams) -> None:
        """Compile the group's grammar off the loop, then queue its requests with matchers."""
        from asyncengine.structured import GrammarMatcher

        assert params.structured is not None
        try:
            compiled = await self._compiled(params.structured)
            matchers = [GrammarMatcher(compiled) for _ in group.held]
        except asyncio.CancelledError:
            return  # aborted while it waited: its compile, if no one else waits, never runs
        except Exception as exc:
            if self.streams.groups.get(group.rid) is group and group.held:
                error = exc
                if not isinstance(exc, InvalidRequestError):
                    log.exception("compiling the grammar of request %s failed", group.rid)
                    error = RequestFailedError(f"request {group.rid} failed: {exc}")
                self.streams.refuse(group, error)
            return
        finally:
            self.waiting -= 1
        if self.streams.groups.get(group.rid) is not group or not group.held:
            return  # aborted while it compiled
        for req, matcher in zip(group.held, matchers, strict=True):
            req.grammar = matcher
        self._add(group)

    async def _compiled(self, constraint: StructuredOutput) -> Any:
        from asyncengine.structured import GrammarCompiler

        if self.compiler is None:
            spec, config = self._core().spec, self.config
            self.compiler = GrammarCompiler(
                self._tokenizer(), spec.vocab_size, spec.eos_token_ids,
                config.grammar_cache_size, config.grammar_compile_workers,
                config.grammar_compile_timeout,
            )  # fmt: skip
        return await self.compiler.compile(constraint)
