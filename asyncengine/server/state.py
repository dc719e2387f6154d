"""What every handler of one app shares: the engine, metrics, served model names, limits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from aiohttp import web

from asyncengine.api.engine_client import EngineClient
from asyncengine.common.outputs import Usage
from asyncengine.server.errors import ApiError
from asyncengine.server.keep_alive import DEFAULT_KEEP_ALIVE_SECONDS
from asyncengine.server.prometheus import ServerMetrics


@dataclass(slots=True)
class ServerState:
    engine: EngineClient
    metrics: ServerMetrics
    served_model_names: list[str]
    api_keys: tuple[str, ...] = ()  # any of them opens /v1/* and /generate (none: open)
    cache_isolation: str = "shared"  # or "api-key": one prefix-cache namespace per key (tenancy.py)
    report_cached_tokens: bool = True  # False: responses omit cached_tokens
    # Chat requests without max_tokens generate up to this many tokens (None: up to the context
    # limit, as OpenAI does). Text completions default to 16, OpenAI's documented default.
    default_chat_max_tokens: int | None = None
    # seconds a client gets to send a request's whole body (else 408)
    body_timeout: float = 30.0
    # seconds a stream may send nothing before a keep-alive goes out (0: none; keep_alive.py)
    stream_keep_alive: float = DEFAULT_KEEP_ALIVE_SECONDS
    shutting_down: bool = False
    token_text: Callable[[int], str] = field(init=False)

    def shown_usage(self, usage: Usage) -> Usage:
        """``usage`` as this server reports it: no cached tokens when they are not reported
        (APIs whose usage schema requires the field get 0)."""
        return usage if self.report_cached_tokens else replace(usage, cached_tokens=0)

    def __post_init__(self) -> None:
        engine = self.engine

        @lru_cache(maxsize=1 << 16)
        def token_text(token_id: int) -> str:
            # The tokenizer exists only once the engine has started: look it up on use.
            return engine.tokenizer.decode([token_id], skip_special_tokens=False)

        self.token_text = token_text

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters the engine serves now (an engine without them: none)."""
        return sorted(getattr(self.engine, "lora_adapters", {}))

    def check_model(self, requested: str | None, adapters: bool = False) -> str:
        """The model name to answer with; 404 ``model_not_found`` for a model we do not serve.
        ``adapters``: the route runs LoRA adapters, named as models (``lora_for``)."""
        if requested is None or requested in self.served_model_names:
            return requested or self.model_name
        served = self.served_model_names
        if adapters:
            if requested in self.lora_names:
                return requested
            served = [*served, *self.lora_names]
        raise ApiError(
            404,
            f"the model {requested!r} does not exist on this server; it serves {served}",
            param="model",
            code="model_not_found",
        )

    def lora_for(self, model: str) -> str | None:
        """The LoRA adapter a checked model name selects (None: the base model)."""
        return None if model in self.served_model_names else model


STATE = web.AppKey("asyncengine_state", ServerState)

# request key under which a handler records how its request ended (see metrics middleware)
OUTCOME: Any = (
    web.RequestKey("asyncengine_outcome", str)
    if hasattr(web, "RequestKey")
    else "asyncengine_outcome"
)
