"""AsyncEngine: the asyncio front of an EngineCore: requests in, the core's steps on a worker
thread, step events out to the callers' streams (streams.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncengine.api.embedding import await_embedding, embedding_group
from asyncengine.api.held_groups import HeldGroups
from asyncengine.api.intake import Intake, Prompt
from asyncengine.api.kv_event_publisher import KVEventPublisher
from asyncengine.api.lora_adapters import LoraAdapters
from asyncengine.api.one_time_work import run_between_steps
from asyncengine.api.request_group import ChoiceCollector, RequestGroup
from asyncengine.api.step_loop import StepLoop
from asyncengine.api.streams import Streams
from asyncengine.api.summary_log import SummaryLog
from asyncengine.cache.pins import Pin, PinLimitError
from asyncengine.common.cache_salt import salted_ids
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.errors import (
    EngineError,
    EngineNotRunningError,
    QueueFullError,
    RequestFailedError,
)
from asyncengine.common.outputs import EmbeddingOutput, GenerateOutput
from asyncengine.common.plan import BatchPlan
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.core.builder import build_core, listed_at_start_up, make_policies
from asyncengine.core.engine_core import EngineCore
from asyncengine.core.executor_api import Executor, defer_one_time_work
from asyncengine.executor.cpu.malloc_reuse import give_back_freed_memory
from asyncengine.policies.eviction_registry import listed_rule
from asyncengine.policies.registry import listed_names
from asyncengine.scheduler.scheduler import Scheduler
from asyncengine.text.stream import RequestStream
from asyncengine.workloads.trace_recorder import TraceRecorder

log = logging.getLogger("asyncengine.api.engine")
# how many times a pin computes a prefix that steps in between evict before it is pinned
PIN_TRIES = 3
NOT_RUNNING = (
    "the engine is not running: use `async with AsyncEngine(...)` or `await engine.start()`"
)


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
        if not isinstance(config, EngineConfig):
            raise TypeError(
                f"config must be an EngineConfig (or None), got {type(config).__name__}: build "
                "one with EngineConfig(...) or EngineConfig.from_toml(path)"
            )
        self.config = config.replace(**overrides) if overrides else config
        if (executor is None) != (tokenizer is None):
            raise ValueError("give both an executor and a tokenizer, or neither")
        self._given = (executor, tokenizer)
        self._policies = make_policies(self.config)  # a bad policy fails before the model loads
        self.config = listed_at_start_up(self.config)
        if self.config.length_predictor == "oracle":
            raise ConfigError(
                "config key 'length_predictor' = 'oracle': the oracle knows output lengths only "
                "in the simulator (from the trace); use history or ranker"
            )
        self.core: EngineCore | None = None
        # called with each step's plan once its tokens are streamed (core.step_hooks run at commit)
        self.step_hooks: list[Callable[[BatchPlan], None]] = []
        self._tokenizer: Any = None
        self._intake: Intake | None = None
        self.streams = Streams(lambda: self._core().now(), self.abort)
        self.held = HeldGroups(
            self.config, self.streams, self._core, lambda: self._tokenizer, self._add
        )
        self._worker: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop start() ran on
        self._steps: StepLoop | None = None
        # the one periodic summary line (config.log_interval); front ends add their counters
        self.summary = SummaryLog(self.stats)
        self._summary_task: asyncio.Task[None] | None = None
        self._one_time_task: asyncio.Task[None] | None = None  # deferred work after start-up
        self.kv_events: KVEventPublisher | None = None  # config.kv_events, from start()
        self.loras = LoraAdapters(self.config.loras)
        self.step_hooks.append(self._sync_loras)

    # -- life cycle ---------------------------------------------------------------------
    async def start(self) -> AsyncEngine:
        if self._task is not None and not self._task.done():
            self._on_own_loop()
            return self
        if self._task is not None:  # its loop ended without stop(): tidy up first
            await self.stop()
        loop = asyncio.get_running_loop()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="asyncengine-forward")
        if self.core is None:
            started = time.perf_counter()
            # what is alive now (the imports: ~180k objects with torch) stays: frozen first, the
            # collection below walks only what the build leaves (~0.08 s of CPU less to ready)
            gc.freeze()
            try:
                core, self._tokenizer = await loop.run_in_executor(self._worker, self._build)
            except BaseException as exc:
                gc.unfreeze()  # no engine runs: nothing of a failed start stays uncollectable
                # nor its forward thread (idle once the build failed; a cancelled build runs on)
                self._worker.shutdown(wait=not isinstance(exc, asyncio.CancelledError))
                self._worker = None
                raise
            self.core = core
            self._intake = Intake(
                self._tokenizer,
                core.spec.vocab_size,
                core.max_model_len,
                self.config,
                self.loras.keys,
            )
            log.info(
                "engine ready in %.1fs: model %s, max_model_len %d, policy %s",
                time.perf_counter() - started,
                self.config.model,
                core.max_model_len,
                core.policy.name,
            )
            if self.config.kv_events is not None:
                core.step_hooks.append(self._publish_kv_events)
        if self.config.kv_events is not None and self.kv_events is None:
            self.kv_events = KVEventPublisher(
                self.config.kv_events, token_ids=self.config.kv_events_token_ids
            )
        # Start-up leaves torch's and the model's objects behind; freezing them keeps the
        # collector's full passes (which stall the loop) short for the rest of the run.
        gc.collect()
        gc.freeze()
        self._steps = StepLoop(
            self._core(), self.streams, self._worker, self.step_hooks, self.abort,
            self.config.enable_overlap_schedule,
        )  # fmt: skip
        self._task = asyncio.create_task(self._steps.run(), name="asyncengine-loop")
        self._loop = loop
        work = defer_one_time_work(self._core().executor)
        if work is not None and self._worker is not None:  # ready now; it runs between steps
            self._one_time_task = asyncio.create_task(
                run_between_steps(self._worker, work, self._core().has_work),
                name="asyncengine-one-time",
            )
        if self.config.log_interval > 0:
            self.summary.reset()
            self._summary_task = asyncio.create_task(
                self.summary.run(self.config.log_interval, log), name="asyncengine-summary"
            )
        return self

    def _build(self) -> tuple[EngineCore, Any]:
        executor, tokenizer = self._given
        if executor is None:  # the real model (loads weights, so it runs on the worker thread)
            from asyncengine.executor.model_executor import model_core

            return model_core(self.config, self._policies)
        return build_core(self.config, executor, policies=self._policies), tokenizer

    async def stop(self) -> None:
        """Abort what is still in flight and stop the loop."""
        if self._task is None:
            return
        if self._task.done():  # its loop ended without stop(): whichever loop runs now tidies up
            self._loop = None
        self._on_own_loop()
        assert self._steps is not None
        self._steps.stopping = True
        if self._one_time_task is not None:
            self._one_time_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._one_time_task
            self._one_time_task = None
        groups = self.streams.groups
        # (a task of a loop that ended is done: only the running loop's are awaited)
        preparing = [g.preparing for g in groups.values() if g.preparing and not g.preparing.done()]
        for rid in list(groups):
            self.abort(rid)
        for task in preparing:
            task.cancel()
        await asyncio.gather(*preparing, return_exceptions=True)
        self._steps.wakeup.set()
        if not self._task.done():  # else its loop ended (and cancelled it): nothing to wait for
            await self._task
        self._task = None
        self._loop = None
        # start() froze every object alive then (this engine's pool and weights among them);
        # a frozen object is never collected, so an engine dropped after stop() would keep its
        # memory (on a GPU, a second engine in the process would find no room for its pool)
        gc.unfreeze()
        if self._summary_task is not None:
            self._summary_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._summary_task
            self._summary_task = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        await self.held.close()
        self.stop_recording()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    async def one_time_work_done(self) -> None:
        """Wait until the work the executor deferred at start-up is done (the int8 panels: a
        benchmark that must not time it waits here); at once where there is none."""
        task = self._one_time_task
        if task is not None:
            await asyncio.shield(task)

    async def close(self) -> None:
        """``stop``, then let go of the model, its KV pool and the tokenizer: their memory
        returns now, not once the collector finds the engine's reference cycles (an engine
        closed and then dropped held it until then: a second one loaded in the same process
        doubled the peak), and the C heap's freed pages go back to the OS. A later ``start``
        loads them again."""
        await self.stop()
        self.core = None
        self._steps = None
        self._intake = None
        if self._given[0] is None:  # the tokenizer came with the model: it goes with it
            self._tokenizer = None
        gc.collect()
        give_back_freed_memory()

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def is_running(self) -> bool:
        running = self._task is not None and not self._task.done()
        return running and self._steps is not None and not self._steps.stopping

    def _on_own_loop(self) -> None:
        """Raise unless called on the event loop that started the engine: its requests, streams
        and step loop belong to that loop (the forward thread aside), none of them thread-safe."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._loop is not None and running is not self._loop:
            raise EngineError(
                "the engine runs on the event loop that started it; call it from a coroutine on "
                "that loop (from another thread: asyncio.run_coroutine_threadsafe(coro, loop))"
            )

    def _core(self) -> EngineCore:
        if self.core is None:
            raise EngineNotRunningError(NOT_RUNNING)
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
            raise EngineNotRunningError(NOT_RUNNING)
        self._on_own_loop()
        core = self._core()
        prompt_ids, params = self.intake.accept(prompt, params)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        self._check_queue(core)
        group = RequestGroup.create(
            rid,
            prompt_ids,
            params,
            core.now(),
            lambda: self._tokenizer.detokenizer(params.skip_special_tokens, prompt_ids),
        )
        self.streams.open(group)
        self._queue(group, params)
        loop = asyncio.get_running_loop()
        return RequestStream(group.states, rid, self.abort, loop, group.preparing)

    async def embed(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> EmbeddingOutput:
        """``prompt``'s embedding: a prefill-only request through the same scheduler, policy
        and prefix cache, its final hidden states pooled as the model says (``spec.pooling``:
        mean or last token) and normalized (pooling.py). Concurrent calls batch together.
        Of ``params`` it takes priority, timeout, tenant, cache_salt and lora (the adapter's
        hidden states). Bad input raises ``InvalidRequestError`` before anything is queued."""
        return await await_embedding(self._queue_embedding(prompt, params, request_id))

    def _queue_embedding(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None
    ) -> RequestStream:
        if not self.is_running:
            raise EngineNotRunningError(NOT_RUNNING)
        self._on_own_loop()
        core = self._core()
        ids, params = self.intake.accept_embedding(prompt, params)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        self._check_queue(core)
        group = embedding_group(
            rid,
            ids,
            params,
            core.now(),
            lambda: self._tokenizer.detokenizer(True, ids),
            core.spec.pooling,
        )
        self.streams.open(group)
        self._queue(group, params)
        return RequestStream(
            group.states, rid, self.abort, asyncio.get_running_loop(), group.preparing
        )

    def _check_queue(self, core: EngineCore) -> None:
        # a request held for its adapter or grammar waits as much as a queued one
        waiting = len(core.scheduler.waiting) + self.held.waiting
        if waiting >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"{waiting} waiting requests, the most max_waiting_requests allows"
            )

    def _queue(self, group: RequestGroup, params: SamplingParams) -> None:
        """Hand the group to the core now, or hold it until its adapter is back in memory and
        its grammar compiled (held_groups.py)."""
        adapter = self.loras.hold(params.lora, self._lora_registry())
        if adapter is not None or params.structured is not None:
            self.held.submit(group, params, adapter)
        else:
            self._add(group)

    def _add(self, group: RequestGroup) -> None:
        """Hand a group's requests to the core: the other choices follow (fork) choice 0."""
        self._core().add(group.held[0], followers=group.held[1:])
        group.held = []
        self._wake()

    def _wake(self) -> None:
        """Wake the step loop: a launch may run something now (an arrival, or a change to
        what waits or to the policy that holds it)."""
        if self._steps is not None:
            self._steps.wakeup.set()

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request (all its choices); its KV pages are released
        (cached prefix kept)."""
        group = self.streams.groups.get(request_id)
        if group is None:
            return False
        self._on_own_loop()
        core = self._core()
        if group.preparing is not None and not group.preparing.done():
            group.preparing.cancel()  # a read or compile no one else waits for never starts
        held = group.end_held(core.now())  # its adapter or grammar was still on its way
        for state in group.states:
            if not state.done and state.req not in held:
                core.abort(state.req.rid)
        self.streams.publish(core.events())
        for state in group.states:
            if not state.done:  # held, or already gone from the core
                self.streams.finish(state)
        self._wake()  # a policy holding the others may decide otherwise without it
        return True

    async def reset_prefix_cache(self, reset_counters: bool = False) -> None:
        """Empty the radix cache; only while idle. ``reset_counters``: the counts of
        ``stats()`` start again too (a replay's warm-up kept out of its measured run)."""
        try:
            self._core().reset_prefix_cache(reset_counters)
        except RuntimeError as exc:
            raise EngineError(str(exc)) from None
        self._publish_kv_events()

    def _publish_kv_events(self, plan: BatchPlan | None = None) -> None:
        """What the radix cache stored and removed since the last call, to the subscribers."""
        if self.kv_events is not None:
            self.kv_events.publish(self._core().kv.tree.drain_events())

    def stats(self) -> dict[str, Any]:
        return {**self._core().stats(), "model": self.model_name}

    # -- LoRA adapters (api/lora_adapters.py) -------------------------------------------
    @property
    def lora_adapters(self) -> dict[str, str]:
        """The adapters served now: name -> PEFT directory."""
        return dict(self.loras.paths)

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` (replacing one of that name);
        InvalidRequestError, with nothing changed, when the base model refuses it."""
        if self._worker is None:
            raise EngineNotRunningError(NOT_RUNNING)
        registry = getattr(self._core().executor, "loras", None)
        await self.loras.load(name, path, registry, self._worker, self.model_name)

    def unload_lora(self, name: str) -> None:
        """Stop serving ``name``: new requests for it are refused (UnknownAdapterError); those in
        flight finish under it, then its weights are dropped."""
        self.loras.unload(name)
        self._sync_loras()

    def _lora_registry(self) -> Any:
        """The executor's LoraRegistry (None: an executor that serves no adapters)."""
        return getattr(self.core.executor if self.core else None, "loras", None)

    def _sync_loras(self, plan: BatchPlan | None = None) -> None:
        """Only the adapters of requests in flight stay held in memory; unloaded ones no
        request runs under go."""
        registry = self._lora_registry()
        worker = self._worker
        bounded = getattr(registry, "max_loaded", None) is not None  # else all stay in memory
        if registry is None or worker is None or not (bounded or self.loras.retiring):
            return
        in_flight = {
            state.req.lora
            for group in self.streams.groups.values()
            for state in group.states
            if not state.done and state.req.lora is not None
        }
        if bounded:
            registry.release_all_but(in_flight)
        # on the forward thread, between steps: a step never sees the registry change
        self.loras.drop_idle(in_flight, lambda name: worker.submit(registry.remove, name))

    def set_policy(self, spec: str, options: dict[str, Any] | None = None) -> str:
        """Swap the scheduling policy (``"lpm"``, ``"priority+dynamic-chunking"``, a
        ``"pkg.mod:Class"``, with ``options`` as in ``policy_options``) at the next step
        boundary, without touching running requests or KV memory. A bad name or option raises
        ConfigError (a ValueError) and changes nothing. Returns the policy it replaces. A
        policy loaded at start-up (``allowed_policies``, the start-up policy) may be named by
        its ``name``."""
        spec = listed_names(spec, self.config.allowed_policies)
        core = self._core()
        previous = core.set_policy(spec, options)
        self.config = self.config.replace(policy=spec, policy_options=dict(options or {}))
        if self.streams.recorder is not None:
            self.streams.recorder.policy_swap(spec, self.config.policy_options, core.now())
        self._wake()  # the new policy may admit what the old one held
        return previous

    def policy_in_charge(self) -> tuple[str, dict[str, Any]]:
        """The policy (spec, options) in charge from the next step: the last ``set_policy``'s,
        or FCFS's once the policy failed (a hook raised or answered what cannot be, or it
        stalled: policy_failures in ``stats()``)."""
        config = self._core().scheduler.policy_in_charge()
        return config.policy, dict(config.policy_options)

    def set_eviction_policy(self, spec: str, options: dict[str, Any] | None = None) -> str:
        """Order the prefix cache's evictions by another rule (``"lfu"``, ``"arc"``,
        ``"queue-aware"``, ``"cost-aware"``, ``"lru"``, a ``"pkg.mod:Class"``, with ``options``
        as in ``eviction_policy_options``) from now on; cached pages stay. A bad name or option
        raises ConfigError (a ValueError) and changes nothing. Returns the rule it replaces. A
        rule loaded at start-up may be named by its ``name``."""
        spec = listed_rule(spec, self.config.allowed_eviction_policies)
        previous = self._core().set_eviction_policy(spec, options)
        self.config = self.config.replace(
            eviction_policy=spec, eviction_policy_options=dict(options or {})
        )
        return previous

    async def pin(
        self,
        prompt: Prompt,
        ttl_s: float | None = None,
        *,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
    ) -> Pin:
        """Keep ``prompt``'s whole pages (a system prompt, a few-shot block) in the prefix cache,
        out of eviction, until ``unpin(pin.pin_id)`` or ``ttl_s`` seconds; computes them first
        when they are not cached. ``cache_salt``: the pages of the requests with that salt (the
        salts' namespaces share nothing). Raises InvalidRequestError for a prompt shorter than a
        page, PinLimitError (a ValueError) past ``max_pinned_fraction`` of the pool or when the
        pages it computed were evicted ``PIN_TRIES`` times before it could pin them.
        ``add_special_tokens``: a text prompt is tokenized as ``generate`` tokenizes it, so
        that its pages are those a request starting with it keys."""
        core = self._core()
        params = SamplingParams(max_new_tokens=1, temperature=0.0, cache_salt=cache_salt)
        ids = self.intake.tokenize(prompt, add_special_tokens)
        page_size = core.kv.page_size
        whole = len(ids) // page_size * page_size
        if whole == 0:
            raise InvalidRequestError(
                f"a pin needs at least one whole KV page ({page_size} tokens), got {len(ids)}",
                param="prompt",
            )
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidRequestError(f"ttl_s must be > 0 seconds, got {ttl_s}", param="ttl_s")
        core.kv.pins.check_room(whole // page_size)  # refuse before computing anything
        keys = salted_ids(ids, params.cache_salt)
        tree = core.kv.tree
        # the steps that run before this resumes may evict what the computation cached (a
        # pool short of pages): compute it again, then pin with no step in between
        for _ in range(PIN_TRIES if core.kv.enable_prefix_cache else 0):
            if tree.prefix_length(keys, whole) == whole:
                break
            await self.generate(ids, params)
        else:
            if core.kv.enable_prefix_cache and tree.prefix_length(keys, whole) < whole:
                raise PinLimitError(
                    f"the prefix was computed {PIN_TRIES} times and evicted each time before "
                    "it could be pinned: the pool is short of free pages; try again later"
                )
        pin = core.pin(keys[:whole], ttl_s)
        if ttl_s is not None:
            self._wake()  # an idle loop sets its timer for the pin's end
        return pin

    def unpin(self, pin_id: int) -> Pin:
        """Release a pin; KeyError when there is no such pin (unpinned, or past its TTL)."""
        return self._core().unpin(pin_id)

    def record_trace(self, path: str, *, hashed: bool = False) -> TraceRecorder:
        """Write every arrival, finish and step to ``path`` (a live trace; see
        asyncengine/workloads/live_trace.py) until ``stop_recording`` or ``stop``."""
        core = self._core()
        self.stop_recording()
        config = core.config
        meta = {
            "model": self.config.model,
            "policy": config.policy,
            "policy_options": config.policy_options,
        }
        self.streams.recorder = TraceRecorder(
            path, start=core.now(), page_size=core.kv.page_size,
            vocab_size=core.spec.vocab_size, hashed=hashed, meta=meta,
        )  # fmt: skip
        return self.streams.recorder

    def stop_recording(self) -> None:
        if self.streams.recorder is not None:
            self.streams.recorder.close()
            self.streams.recorder = None

    # -- input ----------------------------------------------------------------------------
    @property
    def intake(self) -> Intake:
        """Tokenizes and validates requests (the server's routes share it)."""
        self._core()
        assert self._intake is not None
        return self._intake

    def tokenize(self, prompt: Prompt, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids ``stream`` would queue for ``prompt`` under the same
        ``add_special_tokens`` (a text gets its tokenizer's BOS unless it is False; chat
        messages go through the chat template); ``InvalidRequestError`` for a prompt it would
        refuse."""
        return self.intake.tokenize(prompt, add_special_tokens)
