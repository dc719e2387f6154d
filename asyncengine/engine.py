"""AsyncEngine: the event loop that steps the scheduler and streams results to callers."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from asyncengine.builder import build_core, make_policies
from asyncengine.config import EngineConfig
from asyncengine.core import EngineCore
from asyncengine.errors import (
    EngineError,
    EngineNotRunningError,
    QueueFullError,
    RequestFailedError,
)
from asyncengine.executor_api import Executor
from asyncengine.outputs import GenerateOutput, RequestMetrics, Usage
from asyncengine.plan import BatchPlan, StepOutput
from asyncengine.request import Request
from asyncengine.request_group import ChoiceCollector, RequestGroup
from asyncengine.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.scheduler import Scheduler
from asyncengine.step_events import StepEvents
from asyncengine.summary_log import SummaryLog
from asyncengine.text.stream import RequestStream, StreamState
from asyncengine.text.tokenizer import prompt_token_ids
from asyncengine.workloads.trace_recorder import TraceRecorder

log = logging.getLogger("asyncengine.engine")

Prompt = str | list[int] | list[dict[str, Any]]


@dataclass(slots=True)
class InFlight:
    """A plan whose forward runs on the worker thread."""

    plan: BatchPlan
    future: asyncio.Future[StepOutput]


def build_model_core(config: EngineConfig, policies: Any = None) -> tuple[EngineCore, Any]:
    """The real model's core and its tokenizer (loads weights: run it off the event loop)."""
    from asyncengine.executor.model_executor import ModelExecutor
    from asyncengine.text.tokenizer import Tokenizer

    executor = ModelExecutor(config)
    tokenizer = Tokenizer(executor.model_dir)
    executor.add_eos_token_ids(tokenizer.eos_token_ids)
    return build_core(config, executor, policies=policies), tokenizer


class AsyncEngine:
    """Serve generations from one asyncio loop; the model forward runs on one worker thread.

    Use ``async with AsyncEngine(config) as engine`` (or ``await start()`` / ``await stop()``).
    ``executor`` and ``tokenizer`` replace the real model (tests drive the engine with a
    model-free executor); without them ``start`` loads the model named by the config.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        executor: Executor | None = None,
        tokenizer: Any = None,
        **overrides: Any,
    ) -> None:
        config = config or EngineConfig()
        self.config = config.replace(**overrides) if overrides else config
        if (executor is None) != (tokenizer is None):
            raise ValueError("give both an executor and a tokenizer, or neither")
        self._given = (executor, tokenizer)
        self._policies = make_policies(self.config)  # a bad policy fails before the model loads
        self.core: EngineCore | None = None
        # called with each step's plan once its tokens are streamed (core.step_hooks run at commit)
        self.step_hooks: list[Callable[[BatchPlan], None]] = []
        self._tokenizer: Any = None
        self._streams: dict[str, StreamState] = {}  # by the engine request's id (a choice's)
        self._groups: dict[str, RequestGroup] = {}  # by the caller's request id
        self._grammars: Any = None  # the GrammarCompiler, made at the first constrained request
        self._worker: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._stopping = False
        # the one periodic summary line (config.log_interval); front ends add their counters
        self.summary = SummaryLog(self.stats)
        self._summary_task: asyncio.Task[None] | None = None
        self.recorder: TraceRecorder | None = None

    # -- life cycle ---------------------------------------------------------------------
    async def start(self) -> AsyncEngine:
        if self._task is not None:
            return self
        loop = asyncio.get_running_loop()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="asyncengine-forward")
        if self.core is None:
            started = time.perf_counter()
            core, self._tokenizer = await loop.run_in_executor(self._worker, self._build)
            self.core = core
            log.info(
                "engine ready in %.1fs: model %s, max_model_len %d, policy %s",
                time.perf_counter() - started,
                self.config.model,
                core.max_model_len,
                core.policy.name,
            )
        # Start-up leaves torch's and the model's objects behind; freezing them keeps the
        # collector's full passes (which stall the loop) short for the rest of the run.
        gc.collect()
        gc.freeze()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._task = asyncio.create_task(self._run_loop(), name="asyncengine-loop")
        if self.config.log_interval > 0:
            self.summary.reset()
            self._summary_task = asyncio.create_task(
                self._log_summaries(self.config.log_interval), name="asyncengine-summary"
            )
        return self

    def _build(self) -> tuple[EngineCore, Any]:
        executor, tokenizer = self._given
        if executor is None:
            return build_model_core(self.config, self._policies)
        return build_core(self.config, executor, policies=self._policies), tokenizer

    async def stop(self) -> None:
        """Abort what is still in flight and stop the loop."""
        if self._task is None:
            return
        self._stopping = True
        compiling = [g.compiling for g in self._groups.values() if g.compiling is not None]
        for rid in list(self._groups):
            self.abort(rid)
        for task in compiling:
            task.cancel()
        await asyncio.gather(*compiling, return_exceptions=True)
        assert self._wakeup is not None
        self._wakeup.set()
        await self._task
        self._task = None
        if self._summary_task is not None:
            self._summary_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._summary_task
            self._summary_task = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if self._grammars is not None:
            self._grammars.close()
            self._grammars = None
        self.stop_recording()

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping

    def _core(self) -> EngineCore:
        if self.core is None:
            raise EngineNotRunningError(
                "the engine is not started: use `async with AsyncEngine(...)` or `await engine.start()`"
            )
        return self.core

    @property
    def scheduler(self) -> Scheduler:
        return self._core().scheduler

    @property
    def executor(self) -> Executor:
        return self._core().executor

    @property
    def tokenizer(self) -> Any:
        self._core()
        return self._tokenizer

    @property
    def model_name(self) -> str:
        self._core()
        return self.config.model

    @property
    def max_model_len(self) -> int:
        return self._core().max_model_len

    @property
    def vocab_size(self) -> int:
        return self._core().spec.vocab_size

    # -- public API ----------------------------------------------------------------------
    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> GenerateOutput:
        """Run one request to the end and return its whole output (n = 1: see generate_choices)."""
        if params is not None and isinstance(params, SamplingParams) and params.n > 1:
            raise InvalidRequestError(
                f"n={params.n} gives several outputs: use generate_choices() or stream()"
            )
        return (await self.generate_choices(prompt, params, request_id=request_id))[0]

    async def generate_choices(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> list[GenerateOutput]:
        """Run one request to the end and return its ``params.n`` outputs, in index order."""
        stream = self.stream(prompt, params, request_id=request_id)
        collector = ChoiceCollector(len(stream.states), stream.state.req.params.logprobs)
        async for delta in stream:
            collector.add(delta)
            outputs = collector.complete()
            if outputs is not None:
                return outputs
        raise RequestFailedError(f"request {stream.request_id} ended without a final output")

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request and return an async iterator of its StreamDeltas (those of its
        ``params.n`` choices, each marked with its ``index``).

        Leaving the iteration early (or cancelling the task that iterates) aborts the request.
        Bad input raises ``InvalidRequestError`` here, before anything is queued; a structured
        output spec that does not compile raises it from the iteration, before any delta.
        """
        if not self.is_running:
            raise EngineNotRunningError("the engine is not running")
        core = self._core()
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        prompt_ids = self.tokenize(prompt)
        self._check_request(prompt_ids, params)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        waiting = len(core.scheduler.waiting)
        if waiting >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"{waiting} requests are waiting (max_waiting_requests); try again later"
            )
        group = RequestGroup.create(
            rid,
            prompt_ids,
            params,
            core.now(),
            lambda: self._tokenizer.detokenizer(params.skip_special_tokens, prompt_ids),
        )
        if rid in self._groups or any(s.req.rid in self._streams for s in group.states):
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        self._groups[rid] = group
        for state in group.states:
            self._streams[state.req.rid] = state
            if self.recorder is not None:
                self.recorder.arrival(state.req)
        if params.structured is not None:
            group.compiling = asyncio.create_task(self._compile_then_add(group, params))
        else:
            self._add(group)
        return RequestStream(group.states, rid, self.abort, asyncio.get_running_loop())

    def _add(self, group: RequestGroup) -> None:
        """Hand a group's requests to the core: the other choices follow (fork) choice 0."""
        self._core().add(group.held[0], followers=group.held[1:])
        group.held = []
        assert self._wakeup is not None
        self._wakeup.set()

    async def _compile_then_add(self, group: RequestGroup, params: SamplingParams) -> None:
        """Compile the group's grammar off the loop, then queue its requests with matchers."""
        from asyncengine.structured import GrammarCompiler, GrammarMatcher

        assert params.structured is not None
        try:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self._tokenizer,
                    self.vocab_size,
                    self._core().spec.eos_token_ids,
                    cache_size=self.config.grammar_cache_size,
                )
            compiled = await self._grammars.compile(params.structured)
            matchers = [GrammarMatcher(compiled) for _ in group.held]
        except Exception as exc:
            if self._groups.get(group.rid) is group and group.held:
                error = exc
                if not isinstance(exc, InvalidRequestError):
                    log.exception("compiling the grammar of request %s failed", group.rid)
                    error = RequestFailedError(f"request {group.rid} failed: {exc}")
                group.end_held(self._core().now())
                del self._groups[group.rid]
                for state in group.states:
                    self._streams.pop(state.req.rid, None)
                    state.done = True
                group.states[0].fail(error)
            return
        if self._groups.get(group.rid) is not group or not group.held:
            return  # aborted while it compiled
        for req, matcher in zip(group.held, matchers, strict=True):
            req.grammar = matcher
        self._add(group)

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request (all its choices); its KV pages are released
        (cached prefix kept)."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        core = self._core()
        held = group.end_held(core.now())  # its grammar was still compiling
        for state in group.states:
            if not state.done and state.req not in held:
                core.abort(state.req.rid)
        self._publish(core.events())
        for state in group.states:
            if not state.done:
                self._finish_stream(state)
        return True

    def reset_prefix_cache(self, reset_counters: bool = False) -> None:
        """Empty the radix cache (and optionally its hit/miss counters); only while idle."""
        try:
            self._core().reset_prefix_cache(reset_counters)
        except RuntimeError as exc:
            raise EngineError(str(exc)) from None

    def stats(self) -> dict[str, Any]:
        return {**self._core().stats(), "model": self.model_name}

    def set_policy(self, spec: str, options: dict[str, Any] | None = None) -> str:
        """Swap the scheduling policy (``"lpm"``, ``"priority+dynamic-chunking"``, a
        ``"pkg.mod:Class"``, with ``options`` as in ``policy_options``) at the next step
        boundary, without touching running requests or KV memory. A bad name or option raises
        ConfigError (a ValueError) and changes nothing. Returns the policy it replaces."""
        previous = self._core().set_policy(spec, options)
        self.config = self.config.replace(policy=spec, policy_options=dict(options or {}))
        return previous

    def record_trace(self, path: str, *, hashed: bool = False) -> TraceRecorder:
        """Write every arrival, finish and step to ``path`` (a live trace; see
        asyncengine/workloads/live_trace.py) until ``stop_recording`` or ``stop``."""
        core = self._core()
        self.stop_recording()
        self.recorder = TraceRecorder(
            path,
            start=core.now(),
            page_size=core.kv.page_size,
            vocab_size=core.spec.vocab_size,
            hashed=hashed,
            meta={"model": self.config.model, "policy": core.config.policy},
        )
        return self.recorder

    def stop_recording(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    # -- input checks --------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        """The token ids ``stream`` would queue for ``prompt`` (chat messages go through the
        chat template); ``InvalidRequestError`` for a prompt it would refuse."""
        return prompt_token_ids(self.tokenizer, prompt, self.vocab_size)

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        max_model_len, vocab = self.max_model_len, self.vocab_size
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty after tokenization")
        if len(prompt_ids) >= max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_ids)} tokens but the context is {max_model_len} tokens "
                "(max_model_len), leaving no room to generate"
            )
        limit = self.config.max_new_tokens_limit
        if limit is not None and params.max_new_tokens > limit:
            raise InvalidRequestError(
                f"max_new_tokens={params.max_new_tokens} is above this engine's "
                f"max_new_tokens_limit ({limit})"
            )
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"stop token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        if params.n > self.config.max_n:
            raise InvalidRequestError(
                f"n={params.n} is more choices than this engine allows (max_n={self.config.max_n})"
            )
        if params.structured is not None and not hasattr(self._tokenizer, "backend"):
            raise InvalidRequestError("structured output needs the model's own tokenizer")

    # -- the loop ------------------------------------------------------------------------
    async def _run_loop(self) -> None:
        """Launch, await the forward on the worker thread, land, stream. The step itself is
        the core's; this loop adds only overlap (``enable_overlap_schedule``: the next step
        launches before this one's tokens stream) and streaming."""
        core = self._core()
        overlap = self.config.enable_overlap_schedule
        assert self._wakeup is not None
        pending: InFlight | None = None
        try:
            while not self._stopping:
                if pending is None:
                    if not core.has_work():
                        self._wakeup.clear()
                        await self._wakeup.wait()
                        continue
                    pending = self._launch(core)
                    if pending is None:
                        await asyncio.sleep(0.002)  # nothing fits yet; let aborts and arrivals in
                        continue
                step, pending = pending, None
                try:
                    output: StepOutput | BaseException = await step.future
                except Exception as exc:  # one bad forward fails its batch, not the engine
                    output = exc
                events = core.land(step.plan, output)
                if self.recorder is not None and events.error is None:
                    self.recorder.step(step.plan, events.forward_seconds, core.now())
                if overlap and not self._stopping and core.has_work():
                    # The next forward runs while this step's tokens stream. A request ended
                    # here by an abort is in the next plan too: its token there is dropped at
                    # land, and its pages are reused only by a plan made after that forward.
                    pending = self._launch(core)
                self._publish(events)
                for hook in self.step_hooks:
                    hook(step.plan)
                if pending is None:
                    # Let the callers woken by these tokens run now, before the next forward:
                    # run during it, their Python would hold the GIL the forward thread needs
                    # between ops and take a core from its threads (two cores here).
                    await asyncio.sleep(0)
        except Exception as exc:
            log.exception("engine loop crashed")
            for state in list(self._streams.values()):
                self._fail_stream(state.req, exc)
            raise
        finally:
            if pending is not None:  # let the forward finish before the pool goes away
                try:
                    await pending.future
                except Exception:  # its requests are aborted below either way
                    log.warning(
                        "forward of step %d, launched before the loop stopped, failed",
                        pending.plan.step,
                        exc_info=True,
                    )
            for rid in list(self._groups):
                self.abort(rid)

    def _launch(self, core: EngineCore) -> InFlight | None:
        """The core's next plan, its forward started on the worker thread (None: no plan);
        what ended at launch (deadlines) streams at once."""
        plan = core.launch()
        self._publish(core.events())
        if plan is None:
            return None
        future = asyncio.get_running_loop().run_in_executor(
            self._worker, core.executor.execute, plan
        )
        return InFlight(plan, future)

    def _publish(self, events: StepEvents) -> None:
        """Turn a step's events into stream updates: tokens as deltas, ends as final deltas."""
        streams = self._streams
        for ev in events.tokens:
            state = streams.get(ev.req.rid)
            if state is None or state.req is not ev.req:
                continue
            state.add_token(ev.token_id, ev.logprobs)
            if not ev.req.finished:
                state.flush_delta()
        for req in events.failed:
            assert events.error is not None
            self._fail_stream(req, events.error)
        for req in events.ended:
            state = streams.get(req.rid)
            if state is not None and state.req is req:
                self._finish_stream(state)

    def _finish_stream(self, state: StreamState) -> None:
        req = state.req
        self._streams.pop(req.rid, None)
        if self.recorder is not None:
            self.recorder.finish(req, self._core().now())
        group = self._groups.get(state.request_id)
        if group is not None and all(s.done or s is state for s in group.states):
            del self._groups[state.request_id]
        end = req.finished_time or self._core().now()
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
        usage = Usage(len(req.prompt_ids), len(req.output_ids), req.cached_tokens)
        state.finish(usage, metrics)

    def _fail_stream(self, req: Request, exc: BaseException) -> None:
        state = self._streams.get(req.rid)
        if state is None or state.req is not req:
            return
        del self._streams[req.rid]
        if self.recorder is not None:
            self.recorder.finish(req, self._core().now(), "failed")
        state.fail(RequestFailedError(f"request {req.rid} failed: {type(exc).__name__}: {exc}"))
        self.abort(state.request_id)  # the request's other choices end with it

    async def _log_summaries(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            line = self.summary.line()
            if line is not None:
                log.info("%s", line)
