"""Embeddings through the engine: a prefill-only request (one output token, never streamed)
whose final hidden states are pooled (common/pooling.py); its stream ends with the embedding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncengine.api.request_group import RequestGroup
from asyncengine.common.errors import RequestFailedError
from asyncengine.common.outputs import EmbeddingOutput
from asyncengine.common.pooling import PooledEmbedding
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.text.stream import RequestStream


def embedding_group(
    rid: str,
    ids: list[int],
    params: SamplingParams,
    now: float,
    detokenizer: Callable[[], Any],
    pooling: str,
) -> RequestGroup:
    """The group of one embedding request (``params``: Intake.accept_embedding's), its
    pooling set (``spec.pooling``)."""
    group = RequestGroup.create(rid, ids, params, now, detokenizer)
    group.held[0].embedding = PooledEmbedding(pooling)
    return group


async def await_embedding(stream: RequestStream) -> EmbeddingOutput:
    """The embedding ``stream`` ends with (the request is aborted if the caller leaves)."""
    try:
        async for delta in stream:
            if not delta.finished:
                continue
            assert delta.usage is not None and delta.metrics is not None
            if delta.embedding is None:
                raise RequestFailedError(
                    f"request {stream.request_id} ended ({delta.finish_reason}) before "
                    "its embedding was computed"
                )
            return EmbeddingOutput(
                stream.request_id,
                delta.embedding,
                delta.usage.prompt_tokens,
                delta.usage.cached_tokens,
                delta.metrics,
            )
    finally:
        await stream.aclose()
    raise RequestFailedError(f"request {stream.request_id} ended without an embedding")
