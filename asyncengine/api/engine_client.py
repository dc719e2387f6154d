"""EngineClient: what a front end (the HTTP server, the SGLang-router worker endpoints) needs of
an engine. ``AsyncEngine`` (one engine in this process) and the Ray ``RemoteEngine`` (replicas
behind a router) both implement it, with the same sync/async shape, and the server is typed
against it (tests/api/test_engine_client.py checks both classes against it)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from asyncengine.api.intake import Intake, Prompt
from asyncengine.common.config import EngineConfig
from asyncengine.common.outputs import EmbeddingOutput, GenerateOutput, StreamDelta
from asyncengine.common.sampling_params import SamplingParams


class DeltaStream(Protocol):
    """One request's deltas (text/stream.py ``RequestStream``; Ray: ``RemoteStream``)."""

    def __aiter__(self) -> DeltaStream: ...
    async def __anext__(self) -> StreamDelta: ...
    async def accepted(self) -> None:
        """Return once only a failed forward can end the request with an error (headers may
        go out); raise the engine's refusal (a grammar that did not compile) instead."""
        ...

    async def admitted(self) -> int | None:
        """Return once the request was first scheduled, with its prompt tokens read from the
        prefix cache (None: not told, then the first delta's ``cached_tokens`` says it), or
        once it has a delta or an error to hand out."""
        ...

    async def aclose(self) -> None:
        """Abort the request unless it already ended."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig

    async def start(self) -> Any: ...
    async def stop(self) -> None: ...
    @property
    def is_running(self) -> bool: ...
    def abort(self, request_id: str) -> bool: ...
    @property
    def model_name(self) -> str: ...
    async def reset_prefix_cache(self, reset_counters: bool = False) -> None: ...
    @property
    def max_model_len(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    @property
    def vocab_size(self) -> int: ...
    def tokenize(self, prompt: Prompt, *, add_special_tokens: bool = True) -> list[int]: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def intake(self) -> Intake:
        """Tokenizes and validates requests as the engine will (the routes share it)."""
        ...

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> DeltaStream:
        """The request's deltas; leaving the iteration early aborts it (``aclose``)."""
        ...

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> GenerateOutput: ...

    async def generate_choices(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> list[GenerateOutput]: ...

    async def embed(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> EmbeddingOutput:
        """``prompt``'s embedding (a prefill-only request; asyncengine/common/pooling.py)."""
        ...
