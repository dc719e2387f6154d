"""Per-request output side: queue the deltas of landed tokens and their text for the caller
(the text is detokenized, and stop strings checked, where the tokens land: output_text.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from asyncengine.common.outputs import RequestMetrics, StreamDelta, Usage
from asyncengine.common.plan import TokenLogprobs
from asyncengine.common.request import Request
from asyncengine.scheduler.prompt_scoring import prompt_logprobs_by_position
from asyncengine.text.delta_queue import DeltaQueue
from asyncengine.text.output_text import OutputText


class StreamState:
    """Text produced so far for one request, and the deltas not yet read by its caller.

    The choices of an n > 1 request are one StreamState each (``index``), sharing one queue.
    """

    def __init__(
        self,
        req: Request,
        text: OutputText,
        queue: DeltaQueue[StreamDelta | BaseException] | None = None,
        index: int = 0,
        request_id: str | None = None,
        prompt_scorer: Request | None = None,
    ) -> None:
        """``prompt_scorer``: the request whose prompt logprobs this choice's first delta
        carries (choice 0 scores the prompt for every choice); None: none asked for."""
        self.req = req
        self.prompt_scorer = prompt_scorer
        self.request_id = req.rid if request_id is None else request_id  # the caller's id
        self.text = text
        self.index = index
        self.queue: DeltaQueue[StreamDelta | BaseException] = queue or DeltaQueue()
        self.ready = ""  # text cleared for the caller, not yet handed out
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.done = False

    def add_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """Take one landed token (its text is in ``self.text`` already)."""
        self.tokens.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        self.ready += self.text.take()

    def flush_delta(self) -> None:
        """Queue what can be shown now (text that cannot still turn into a stop string)."""
        if self.ready or self.tokens:
            self.queue.put_nowait(self._delta())

    def finish(self, now: float) -> None:
        """Queue the final delta: the rest of the text, the finish reason, usage and metrics
        (``now`` stands for the end time of a request that never reached the core)."""
        req = self.req
        end = req.finished_time or now
        usage = Usage(
            len(req.prompt_ids), len(req.output_ids), req.cached_tokens, req.accepted_guesses
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            queue_time=None
            if req.first_scheduled_time is None
            else req.first_scheduled_time - req.arrival_time,
            ttft=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            e2e=end - req.arrival_time,
            itl=[b - a for a, b in zip(req.token_times, req.token_times[1:], strict=False)],
            retractions=req.retractions,
            cached_tokens=req.cached_tokens,
            tenant=req.params.tenant,
            priority=req.params.priority,
            blocked=dict(req.blocked),
        )
        self.ready += self.text.finish()
        delta = self._delta()
        delta.finished = True
        delta.finish_reason = self.req.finish_reason or "abort"
        delta.matched_stop = self.req.matched_stop
        delta.usage = usage
        delta.metrics = metrics
        if req.embedding is not None and req.finish_reason == "stop":
            delta.embedding = req.embedding.vector
        self.done = True
        self.queue.put_nowait(delta)

    def fail(self, exc: BaseException) -> None:
        self.done = True
        self.queue.put_nowait(exc)

    def _delta(self) -> StreamDelta:
        delta = StreamDelta(
            request_id=self.request_id,
            text=self.ready,
            token_ids=self.tokens,
            logprobs=self.logprobs or None,
            index=self.index,
            cached_tokens=self.req.cached_tokens,
        )
        if self.prompt_scorer is not None:
            delta.prompt_logprobs = prompt_logprobs_by_position(self.prompt_scorer)
            self.prompt_scorer = None
        self.ready = ""
        self.tokens = []
        self.logprobs = []
        return delta


class RequestStream:
    """Async iterator over one request's StreamDeltas (of all its choices, each delta with its
    ``index``, in the order they were produced); leaving it early aborts the request.

    ``abort(request_id)`` is the engine's abort; it runs on ``loop``, the engine's loop (a stream
    dropped by the garbage collector on another thread schedules it there). ``preparing``: the
    task that holds the request until its adapter is in memory and its grammar compiled, which
    may still refuse it (``accepted``).
    """

    def __init__(
        self,
        states: list[StreamState],
        request_id: str,
        abort: Callable[[str], object],
        loop: asyncio.AbstractEventLoop,
        preparing: asyncio.Task[None] | None = None,
    ) -> None:
        self._preparing = preparing
        self.states = states
        self.state = states[0]
        self.request_id = request_id
        self._abort = abort
        self._loop = loop
        self._ended = False
        self._open_choices = len(states)

    def __aiter__(self) -> RequestStream:
        return self

    async def accepted(self) -> None:
        """Return once nothing but a failed forward can end the request with an error (its
        adapter in memory, its grammar compiled; a server can send its headers then); raise its
        refusal instead."""
        preparing = self._preparing
        if preparing is not None and not preparing.done():
            try:
                await asyncio.wait((preparing,))  # an abort that cancels it is not our error
            except BaseException:
                await self.aclose()  # cancelled while waiting: abort the request
                raise
        if isinstance(self.state.queue.peek(), BaseException):
            await self.__anext__()  # raises the refusal

    async def admitted(self) -> int | None:
        """Return once the request was first scheduled (how many of its prompt tokens the
        prefix cache served is known then: that count is returned) or has something to hand
        out (a delta, its end, an error), so that a stream's header can go out before a long
        prefill ends."""
        state = self.state
        while state.req.first_scheduled_time is None and state.queue.empty() and not self._ended:
            try:
                await state.queue.wait()  # woken by a delta, or by Streams.admit
            except BaseException:
                await self.aclose()  # cancelled while waiting: abort the request
                raise
        return state.req.cached_tokens

    async def __anext__(self) -> StreamDelta:
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self.state.queue.get()
        except BaseException:
            await self.aclose()  # cancelled while waiting: abort the request
            raise
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if item.finished:
            self._open_choices -= 1
            self._ended = self._open_choices == 0
        return item

    @property
    def finished(self) -> bool:
        """The final delta (or an error) was handed out, or the stream was closed."""
        return self._ended

    async def aclose(self) -> None:
        """Abort the request unless it already ended (idempotent)."""
        if not self._ended:
            self._ended = True
            self._abort(self.request_id)

    def __del__(self) -> None:
        live = not all(state.done for state in self.states)
        if not self._ended and live and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abort, self.request_id)
