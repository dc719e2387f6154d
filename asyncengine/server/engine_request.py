"""One engine request seen from an HTTP handler: however the handler ends (done, error, client
gone, cancelled), the request is released in the engine and its KV pages freed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from asyncengine.outputs import GenerateOutput, StreamDelta
from asyncengine.sampling_params import SamplingParams
from asyncengine.server.errors import ApiError

Prompt = str | list[int] | list[dict[str, str]]


def outcome_of(*finish_reasons: str | None) -> str:
    """The requests-counter outcome of a request whose choices ended with ``finish_reasons``:
    "abort" if one was aborted, else "timeout" if one ran out of time, else "success"."""
    for outcome in ("abort", "timeout"):
        if outcome in finish_reasons:
            return outcome
    return "success"


class StreamingRequest:
    """Iterate an ``engine.stream`` call; ``close()`` aborts it unless it finished."""

    def __init__(
        self, engine: Any, prompt: Prompt, params: SamplingParams, request_id: str
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.finished = False
        self._stream: AsyncIterator[StreamDelta] = engine.stream(
            prompt, params, request_id=request_id
        )

    async def next(self) -> StreamDelta | None:
        """The next delta, or None once the stream is exhausted. Engine errors propagate."""
        try:
            delta = await self._stream.__anext__()
        except StopAsyncIteration:
            self.finished = True
            return None
        except BaseException:
            # An engine error or cancellation ends the request either way.
            await self.close()
            raise
        if delta.finished:
            self.finished = True
        return delta

    async def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def generate(
    engine: Any, prompt: Prompt, params: SamplingParams, request_id: str
) -> list[GenerateOutput]:
    """``engine.generate_choices`` (one output per choice) that aborts the request if the
    caller is cancelled (client gone).

    A request that ran out of time before any choice produced a token is answered 408 (one
    that started answers 200 with what it produced and finish reason "timeout")."""
    done = False
    try:
        outputs = await engine.generate_choices(prompt, params, request_id=request_id)
        done = True
    finally:
        if not done:
            engine.abort(request_id)
    if all(o.finish_reason == "timeout" and not o.token_ids for o in outputs):
        waited = max(o.metrics.e2e for o in outputs)
        raise ApiError(
            408,
            f"the request timed out after {waited:.3f}s before it produced a token "
            "(its timeout or the server's max_queue_time); retry later or with a longer timeout",
            type="timeout_error",
            code="request_timeout",
        )
    return outputs
