"""asyncengine: an LLM serving engine around one asyncio event loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncengine import compiled

# before any compiled module loads: a stale build must not shadow an edited source
compiled.run_edits_interpreted()

from asyncengine import quiet_exit  # noqa: E402
from asyncengine.common.config import ConfigError, EngineConfig  # noqa: E402
from asyncengine.common.errors import (  # noqa: E402
    AdapterUnavailableError,
    EngineError,
    EngineNotRunningError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
)
from asyncengine.common.sampling_params import SamplingParams, StructuredOutput  # noqa: E402

if TYPE_CHECKING:
    from asyncengine.api.engine import AsyncEngine
    from asyncengine.cache.pins import PinLimitError
    from asyncengine.common.outputs import GenerateOutput, StreamDelta

__version__ = "0.1.0"

quiet_exit.install()

__all__ = [
    "AdapterUnavailableError",
    "AsyncEngine",
    "ConfigError",
    "EngineConfig",
    "EngineError",
    "EngineNotRunningError",
    "GenerateOutput",
    "InvalidRequestError",
    "PinLimitError",
    "QueueFullError",
    "RequestFailedError",
    "SamplingParams",
    "StreamDelta",
    "StructuredOutput",
]


def __getattr__(name: str) -> Any:
    # The engine pulls in torch and the model code; import it only when asked for.
    if name == "AsyncEngine":
        from asyncengine.api.engine import AsyncEngine

        return AsyncEngine
    if name in ("GenerateOutput", "StreamDelta"):
        from asyncengine.common import outputs

        return getattr(outputs, name)
    if name == "PinLimitError":  # the cache's modules load with the engine, not before
        from asyncengine.cache.pins import PinLimitError

        return PinLimitError
    raise AttributeError(f"module 'asyncengine' has no attribute {name!r}")
