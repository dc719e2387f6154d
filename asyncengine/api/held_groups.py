"""Requests held before they are queued: their LoRA adapter read back into memory (when it was
dropped: api/lora_adapters.py) and their structured-output grammar compiled (by the
GrammarCompiler, made at the first constrained request), both off the event loop; then queued,
with their matchers. A failed read or compile refuses the request, before any step runs it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from asyncengine.api.request_group import RequestGroup
from asyncengine.api.streams import Streams
from asyncengine.common.config import EngineConfig
from asyncengine.common.errors import RequestFailedError
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams, StructuredOutput
from asyncengine.core.engine_core import EngineCore

log = logging.getLogger("asyncengine.api.engine")


class HeldGroups:
    """The groups held until their adapter is in memory and their grammar compiled; ``add``
    queues a group once they are."""

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
        self.waiting = 0  # requests held here (counted as waiting)

    def submit(
        self, group: RequestGroup, params: SamplingParams, adapter: Awaitable[None] | None
    ) -> None:
        """Await ``adapter`` (its read back) and compile the group's grammar, if it has one, in
        a task (``group.preparing``: an abort cancels it); then queue the group."""
        self.waiting += 1
        group.preparing = asyncio.create_task(self._prepare_then_add(group, params, adapter))

    async def close(self) -> None:
        """Stop the compiler; waits, off the loop, until its threads and processes are gone."""
        compiler, self.compiler = self.compiler, None
        if compiler is not None:
            await asyncio.get_running_loop().run_in_executor(None, compiler.close)

    async def _prepare_then_add(
        self, group: RequestGroup, params: SamplingParams, adapter: Awaitable[None] | None
    ) -> None:
        """Wait for the adapter, compile the grammar off the loop, then queue the group's
        requests with their matchers."""
        matchers: list[Any] = []  # one GrammarMatcher per held request, with a grammar
        try:
            if adapter is not None:
                await adapter
            if params.structured is not None:
                compiled = await self._compiled(params.structured)
                matchers = [self.compiler.matcher(params.structured, compiled) for _ in group.held]
        except asyncio.CancelledError:
            return  # aborted while it waited: its compile, if no one else waits, never runs
        except Exception as exc:
            if self.streams.groups.get(group.rid) is group and group.held:
                error = exc
                if not isinstance(exc, InvalidRequestError):
                    log.exception("preparing request %s failed", group.rid)
                    error = RequestFailedError(f"request {group.rid} failed: {exc}")
                self.streams.refuse(group, error)
            return
        finally:
            self.waiting -= 1
        if self.streams.groups.get(group.rid) is not group or not group.held:
            return  # aborted while it was held
        for req, matcher in zip(group.held, matchers, strict=False):
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
