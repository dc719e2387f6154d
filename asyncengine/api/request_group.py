"""RequestGroup: the engine-side requests behind one caller's request (its n choices).

Choice ``i`` is its own Request (id ``<rid>`` when n is 1, else ``<rid>-<i>``) with its own
stream state; all share one queue, so the caller reads their deltas in the order they come.
A group's requests are *held* (known to the engine, not yet to the core) while their adapter is
read back and their grammar compiles (held_groups.py); choices 1..n-1 are handed to the core as
choice 0's followers, and the core's lifecycle queues them once choice 0 has prefilled the
prompt, so they take the prompt's pages from the radix cache (a fork) instead of computing them
again.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncengine.common.outputs import GenerateOutput, StreamDelta
from asyncengine.common.plan import TokenLogprobs
from asyncengine.common.request import Request, choice_rid
from asyncengine.common.sampling_params import SamplingParams, choice_seed
from asyncengine.text.delta_queue import DeltaQueue
from asyncengine.text.output_text import OutputText
from asyncengine.text.stream import StreamState


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: a seeded request gives each choice its own seed; choice
    0 alone scores the prompt, and every choice returns its scores (the others fork its cached
    pages; generating nothing, they keep prompt_logprobs, the request's kind, but never run:
    they end with choice 0, lifecycle.py)."""
    if index == 0:
        return params
    if params.seed is not None:
        params = dataclasses.replace(params, seed=choice_seed(params.seed, index))
    if params.prompt_logprobs is not None and params.max_new_tokens > 0:
        params = dataclasses.replace(params, prompt_logprobs=None)
    return params


@dataclass(slots=True, eq=False)
class RequestGroup:
    rid: str
    states: list[StreamState]
    held: list[Request] = field(default_factory=list)  # not yet added to the core
    preparing: asyncio.Task[None] | None = None

    @classmethod
    def create(
        cls,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        detokenizer: Callable[[], Any],
    ) -> RequestGroup:
        queue: DeltaQueue[StreamDelta | BaseException] = DeltaQueue()
        states: list[StreamState] = []
        for i in range(params.n):
            req = Request(
                choice_rid(rid, params.n, i), prompt_ids, choice_params(params, i), arrival_time
            )
            req.text = OutputText(
                detokenizer(), list(params.stop), params.include_stop_str_in_output
            )
            scorer = None
            if params.prompt_logprobs is not None:
                scorer = states[0].req if states else req
            states.append(StreamState(req, req.text, queue, i, rid, scorer))
        return cls(rid, states, held=[s.req for s in states])

    @property
    def done(self) -> bool:
        return all(state.done for state in self.states)

    def end_held(self, now: float) -> list[Request]:
        """End the held requests (reason "abort") without the core, which never saw them."""
        ended, self.held = self.held, []
        for req in ended:
            req.mark_finished("abort", None, now)
        return ended


class ChoiceCollector:
    """Builds each choice's GenerateOutput from the deltas of a group's stream."""

    def __init__(self, n: int, logprobs: bool) -> None:
        self.logprobs = logprobs
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.token_logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]
        self.outputs: list[GenerateOutput | None] = [None] * n
        self.prompt_logprobs: list[list[TokenLogprobs | None] | None] = [None] * n

    def add(self, delta: StreamDelta) -> None:
        i = delta.index
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[i] = delta.prompt_logprobs
        self.texts[i].append(delta.text)
        self.tokens[i].extend(delta.token_ids)
        if delta.logprobs:
            self.token_logprobs[i].extend(delta.logprobs)
        if delta.finished:
            assert delta.usage is not None and delta.metrics is not None
            self.outputs[i] = GenerateOutput(
                request_id=delta.request_id,
                text="".join(self.texts[i]),
                token_ids=self.tokens[i],
                finish_reason=delta.finish_reason,
                usage=delta.usage,
                metrics=delta.metrics,
                matched_stop=delta.matched_stop,
                logprobs=self.token_logprobs[i] if self.logprobs else None,
                index=i,
                prompt_logprobs=self.prompt_logprobs[i],
            )

    def complete(self) -> list[GenerateOutput] | None:
        if any(out is None for out in self.outputs):
            return None
        return [out for out in self.outputs if out is not None]
