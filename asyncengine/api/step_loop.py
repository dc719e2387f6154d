"""The engine's step loop: launch a plan, await its forward on the worker thread, land it,
stream its tokens; with overlap the next plan launches while this one's forward runs (when the
executor fills in the inputs it samples: scheduler/plan_ahead.py), else before its tokens
stream."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import NamedTuple

from asyncengine.api.streams import Streams
from asyncengine.common.plan import BatchPlan, StepOutput
from asyncengine.core.engine_core import EngineCore
from asyncengine.core.executor_api import defers_inputs
from asyncengine.scheduler.policy_guard import IDLE_POLL_SECONDS

log = logging.getLogger("asyncengine.api.engine")


# A decode step of 256 streams makes a few thousand short-lived objects (segments, events,
# deltas, futures): at Python's young-generation threshold (700) the collector ran ~1.4 times a
# step, 0.13 ms of a ~2 ms step's host work, finding nothing to free; at this one, a few times
# a run (`scripts/micro/bench_host_step.py --batches 256`, gc.callbacks timing)
LOOP_GC_THRESHOLD = (50_000, 20, 50)
_running_loops = 0
_threshold_before: tuple[int, int, int] = (700, 10, 10)


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """The collector's thresholds raised while any engine's loop runs (restored after the last)."""
    global _running_loops, _threshold_before
    if _running_loops == 0:
        _threshold_before = gc.get_threshold()
        gc.set_threshold(*LOOP_GC_THRESHOLD)
    _running_loops += 1
    try:
        yield
    finally:
        _running_loops -= 1
        if _running_loops == 0:
            gc.set_threshold(*_threshold_before)


class InFlight(NamedTuple):
    """A plan whose forward runs on the worker thread."""

    plan: BatchPlan
    future: asyncio.Future[StepOutput]
    # an executor that launches in two halves: done when the first half has returned
    launched: asyncio.Future[None] | None = None


class StepLoop:
    """Runs ``core``'s steps until ``stopping``; ``wakeup`` is set when work arrives or what
    waits may change (an abort, a policy swap)."""

    def __init__(
        self,
        core: EngineCore,
        streams: Streams,
        worker: ThreadPoolExecutor | None,
        step_hooks: list[Callable[[BatchPlan], None]],
        abort: Callable[[str], bool],
        overlap: bool,
    ) -> None:
        self.core = core
        self.streams = streams
        self.worker = worker
        self.step_hooks = step_hooks  # the engine's list: hooks added later run too
        self.abort = abort
        self.overlap = overlap
        self.wakeup = asyncio.Event()
        self.stopping = False
        # overlap on an executor that fills in deferred inputs and launches in two halves: the
        # worker thread enqueues each step, this one waits for their outputs in order, so the
        # worker enqueues step N+1 while the device still runs step N
        self.split_launch: Callable[[BatchPlan], Callable[[], StepOutput]] | None = None
        if overlap and defers_inputs(core.executor):
            self.split_launch = getattr(core.executor, "launch", None)
        self.waiter: ThreadPoolExecutor | None = None

    async def run(self) -> None:
        """Launch, await the forward on the worker thread, land, stream. The step itself is
        the core's; this loop adds only overlap (``enable_overlap_schedule``: the next step
        launches while this one's forward runs, or at least before its tokens stream) and
        streaming. While any engine's loop runs, the collector's young generation is large
        (``LOOP_GC_THRESHOLD``)."""
        with _fewer_collections():
            await self._run()

    async def _run(self) -> None:
        core, overlap = self.core, self.overlap
        pending: InFlight | None = None
        try:
            while not self.stopping:
                if pending is None:
                    if not core.has_work():
                        await self._wait_for_work(core)
                        continue
                    pending = self._launch(core)
                    if pending is None:  # nothing fits yet, or the policy holds
                        await self._idle(core)
                        continue
                step, pending = pending, None
                if overlap and core.can_launch_ahead():
                    # Plan the next step while this one's forward runs: its decodes' inputs
                    # are the tokens this forward samples, which the executor fills in; the
                    # forward queues behind this one on the worker thread, so the device goes
                    # from one to the next while this step lands and streams.
                    pending = self._launch(core)
                    if pending is not None and pending.launched is not None:
                        # Its launch goes first: the worker needs the GIL for it, which this
                        # step's landing and streaming would hold for their whole length (the
                        # interpreter hands it over after 5 ms), the device waiting meanwhile.
                        # A captured greedy step's launch returns once enqueued; at batch 256
                        # steps alternated ~2.0 / ~3.4 ms without this, ~2.3 with it
                        # (scripts/micro/bench_host_step.py --device-ms 1.6 --overlap).
                        await pending.launched
                try:
                    output: StepOutput | BaseException = await step.future
                except Exception as exc:  # one bad forward fails its batch, not the engine
                    output = exc
                events = core.land(step.plan, output)
                if pending is None and overlap and not self.stopping and core.has_work():
                    # The next forward runs while this step's tokens stream. A request ended
                    # here by an abort is in the next plan too: its token there is dropped at
                    # land, and its pages are reused only by a plan made after that forward.
                    pending = self._launch(core)
                self.streams.publish(events)
                for hook in self.step_hooks:
                    hook(step.plan)
                if pending is None:
                    # Let the callers woken by these tokens run now, before the next forward:
                    # run during it, their Python would hold the GIL the forward thread needs
                    # between ops and take a core from its threads (two cores here).
                    await asyncio.sleep(0)
        except Exception as exc:
            log.exception("engine loop crashed")
            for state in list(self.streams.states.values()):
                self.streams.fail(state.req, exc)
            raise
        finally:
            if pending is not None:  # let the forward finish before the pool goes away
                try:
                    await pending.future
                except Exception:  # its requests are aborted below either way
                    log.warning("the forward in flight as the loop stopped failed", exc_info=True)
            for rid in list(self.streams.groups):
                self.abort(rid)
            if self.waiter is not None:
                self.waiter.shutdown(wait=True)
                self.waiter = None

    async def _wait_for_work(self, core: EngineCore) -> None:
        """With nothing to run: wait for ``wakeup``, or until the next pin's ``ttl_s`` ends,
        so that an engine with no traffic releases its pages then, not at the next step."""
        until = core.expire_pins()
        self.wakeup.clear()
        if until is None:
            await self.wakeup.wait()
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wakeup.wait(), max(0.0, until - core.now()))

    async def _idle(self, core: EngineCore) -> None:
        """After a launch that ran nothing: wait for new work (``wakeup``: an arrival, an
        abort, a policy swap), or until the holding policy's wake time (``held_until``); with
        none, ask again in ``IDLE_POLL_SECONDS``, since what blocks admission (KV memory, a
        policy that names no time) may change without anything waking the loop."""
        until = core.held_until()
        delay = IDLE_POLL_SECONDS if until is None else max(0.0, until - core.now())
        self.wakeup.clear()
        try:
            await asyncio.wait_for(self.wakeup.wait(), delay)
        except asyncio.TimeoutError:
            pass

    def _launch(self, core: EngineCore) -> InFlight | None:
        """The core's next plan, its forward started on the worker thread (None: no plan);
        what ended at launch (deadlines) streams at once."""
        plan = core.launch()
        self.streams.publish(core.events())
        if plan is None:
            return None
        self.streams.admit(plan)
        loop = asyncio.get_running_loop()
        if self.split_launch is None:
            return InFlight(plan, loop.run_in_executor(self.worker, core.execute, plan))
        return self._launched(self.split_launch, plan)

    def _launched(
        self, launch: Callable[[BatchPlan], Callable[[], StepOutput]], plan: BatchPlan
    ) -> InFlight:
        """``plan`` enqueued on the worker thread (its masks made there first, as
        ``EngineCore.execute`` makes them), which hands the wait for its output to the waiter
        thread (one, so outputs come in launch order); the loop hears when the launch has
        returned and when the output (or an error) is there."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[StepOutput] = loop.create_future()
        launched: asyncio.Future[None] = loop.create_future()

        def mark_launched() -> None:
            if not launched.done():
                launched.set_result(None)

        if self.waiter is None:
            self.waiter = ThreadPoolExecutor(1, thread_name_prefix="asyncengine-wait")
        waiter = self.waiter

        def deliver(output: StepOutput) -> None:
            mark_launched()
            if not future.cancelled():
                future.set_result(output)

        def fail(error: Exception) -> None:  # the loop's to report, as an executor's error
            mark_launched()
            if not future.cancelled():
                future.set_exception(error)

        def wait(collect: Callable[[], StepOutput]) -> None:  # on the waiter thread
            try:
                output = collect()
            except Exception as error:
                loop.call_soon_threadsafe(fail, error)
            else:
                loop.call_soon_threadsafe(deliver, output)

        def start() -> None:  # on the worker thread
            try:
                self.core.make_masks(plan)
                collect = launch(plan)
            except Exception as error:
                loop.call_soon_threadsafe(fail, error)
            else:
                waiter.submit(wait, collect)
                loop.call_soon_threadsafe(mark_launched)

        if self.worker is None:
            loop.run_in_executor(None, start)
        else:
            self.worker.submit(start)
        return InFlight(plan, future, launched)
