"""Exceptions the engine raises to its callers."""

from __future__ import annotations

from asyncengine.common.sampling_params import InvalidRequestError


class EngineError(RuntimeError):
    """Base class of engine-side failures."""


class EngineNotRunningError(EngineError):
    """The engine was never started, or has stopped."""


class RequestFailedError(EngineError):
    """The engine failed this request (for example its forward pass raised); others go on."""


class QueueFullError(EngineError):
    """Too many requests are waiting; try again later."""


class EngineUnavailableError(EngineError):
    """Nothing can take the request for now (every replica of a deployment is down); try again
    later."""


__all__ = [
    "AdapterUnavailableError",
    "EngineError",
    "EngineNotRunningError",
    "EngineUnavailableError",
    "InvalidRequestError",
    "QueueFullError",
    "RequestFailedError",
    "UnknownAdapterError",
]


class UnknownAdapterError(InvalidRequestError):
    """A request names a LoRA adapter the engine does not serve (HTTP 404, as an unknown
    model)."""

    def __init__(self, name: str, served: list[str]) -> None:
        super().__init__(
            f"the LoRA adapter {name!r} is not loaded; loaded adapters: {served}",
            param="model",
            code="model_not_found",
        )
        self.name, self.served = name, served

    def __reduce__(self) -> tuple[type[UnknownAdapterError], tuple[str, list[str]]]:
        # a replica's refusal reaches the router pickled (Ray): rebuilt from the arguments
        return type(self), (self.name, self.served)


class AdapterUnavailableError(InvalidRequestError):
    """A request names a served LoRA adapter whose weights are not in memory and could not be
    read back from its directory (deleted, unreadable or corrupt): HTTP 404. Its other requests
    are refused the same way until the files are back or the adapter is unloaded."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"the LoRA adapter {name!r} is unavailable: its weights could not be read from its "
            "directory (the server's log says why); restore its files, or load it again",
            param="model",
            code="adapter_unavailable",
        )
        self.name = name

    def __reduce__(self) -> tuple[type[AdapterUnavailableError], tuple[str]]:
        return type(self), (self.name,)
