"""The non-streaming tail every endpoint shares: run a request to the end, all its choices.

A client that disconnects cancels the handler, and the engine's stream aborts the request.
"""

from __future__ import annotations

from asyncengine.api.engine_client import EngineClient
from asyncengine.common.outputs import GenerateOutput
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.server.errors import ApiError

Prompt = str | list[int] | list[dict[str, str]]


def outcome_of(*finish_reasons: str | None) -> str:
    """The requests-counter outcome of a request whose choices ended with ``finish_reasons``:
    "abort" if one was aborted, else "timeout" if one ran out of time, else "success"."""
    for outcome in ("abort", "timeout"):
        if outcome in finish_reasons:
            return outcome
    return "success"


async def generate(
    engine: EngineClient, prompt: Prompt, params: SamplingParams, request_id: str
) -> list[GenerateOutput]:
    """``engine.generate_choices``: one output per choice, in index order.

    A request that ran out of time before any choice produced a token is answered 408 (one
    that started answers 200 with what it produced and finish reason "timeout")."""
    outputs: list[GenerateOutput] = await engine.generate_choices(
        prompt, params, request_id=request_id
    )
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
