"""Streams: the callers' side of the requests in an AsyncEngine.

Each caller's request is a RequestGroup (its n choices, each a StreamState); ``publish`` turns
the core's step events into stream updates: a landed token becomes a delta, an ended request a
final delta (a failed one an error). Nothing here decides that a request ends: the core's
lifecycle does, and reports it in the events.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncengine.api.request_group import RequestGroup
from asyncengine.common.errors import RequestFailedError
from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import InvalidRequestError
from asyncengine.scheduler.step_events import StepEvents
from asyncengine.text.stream import StreamState
from asyncengine.workloads.trace_recorder import TraceRecorder


class Streams:
    def __init__(self, now: Callable[[], float], abort: Callable[[str], bool]) -> None:
        self.now = now
        self.abort = abort  # the engine's: ends a caller's request, all its choices
        self.groups: dict[str, RequestGroup] = {}  # by the caller's request id
        self.states: dict[str, StreamState] = {}  # by the engine request's id (a choice's)
        self.recorder: TraceRecorder | None = None

    def open(self, group: RequestGroup) -> None:
        """Register ``group``'s streams; ``InvalidRequestError`` when its id is in use."""
        if group.rid in self.groups or any(s.req.rid in self.states for s in group.states):
            raise InvalidRequestError(f"request id {group.rid!r} is already in use")
        self.groups[group.rid] = group
        for state in group.states:
            self.states[state.req.rid] = state
        if self.recorder is not None:
            self.recorder.arrival(group.states[0].req, group.rid)

    def refuse(self, group: RequestGroup, error: BaseException) -> None:
        """End a group the core never saw (its grammar did not compile) with ``error``."""
        group.end_held(self.now())
        del self.groups[group.rid]
        for state in group.states:
            self.states.pop(state.req.rid, None)
            state.done = True
        group.states[0].fail(error)

    def admit(self, plan: BatchPlan) -> None:
        """Wake the readers of the requests whose prompt chunks ``plan`` computes: one waiting
        for its request's first scheduling (``RequestStream.admitted``) goes on."""
        states = self.states
        for seg in plan.extends:
            state = states.get(seg.rid)
            if state is not None:
                state.queue.wake()

    def publish(self, events: StepEvents) -> None:
        """Tokens as deltas, ended requests as final deltas, failed ones as errors (and the
        step into the live trace, when one is recorded)."""
        if self.recorder is not None and events.plan is not None and events.error is None:
            self.recorder.step(events.plan, events.forward_seconds, self.now())
        states = self.states
        touched: list[StreamState] = []  # in order; a request's tokens of a step are adjacent
        for ev in events.tokens:
            state = states.get(ev.req.rid)
            if state is None or state.req is not ev.req:
                continue
            state.add_token(ev.token_id, ev.logprobs)
            if not touched or touched[-1] is not state:
                touched.append(state)
        for state in touched:  # one delta per request and step (accepted guesses together)
            if not state.req.finished:
                state.flush_delta()
        for req in events.failed:
            assert events.error is not None
            self.fail(req, events.error)
        for req in events.ended:
            state = states.get(req.rid)
            if state is not None and state.req is req:
                self.finish(state)

    def finish(self, state: StreamState) -> None:
        req = state.req
        self.states.pop(req.rid, None)
        if self.recorder is not None:
            self.recorder.finish(req, self.now())
        group = self.groups.get(state.request_id)
        if group is not None and all(s.done or s is state for s in group.states):
            del self.groups[state.request_id]
        state.finish(self.now())

    def fail(self, req: Request, exc: BaseException) -> None:
        """``req``'s forward failed: its caller gets the error; its other choices end."""
        state = self.states.get(req.rid)
        if state is None or state.req is not req:
            return
        del self.states[req.rid]
        if self.recorder is not None:
            self.recorder.finish(req, self.now(), "failed")
        state.fail(RequestFailedError(f"request {req.rid} failed: {type(exc).__name__}: {exc}"))
        self.abort(state.request_id)  # ends its other choices, whose last finish forgets it
        group = self.groups.get(state.request_id)
        if group is not None and all(s.done for s in group.states):
            del self.groups[state.request_id]  # no other choice was left to finish
